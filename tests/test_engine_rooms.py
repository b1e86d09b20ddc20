"""The engine layer's own rules (docs/engines.md): a room imports only the base, errors and log,
never another room, the drain, the gate, the flows or prefect; the base imports no room."""

from __future__ import annotations

import ast
from pathlib import Path

from pinrotate_core import engines
from pinrotate_core.engines.mysql.room import ROOM
from pinrotate_core.engines.postgresql.features import FEATURES as POSTGRES_FEATURES

ENGINES = Path(engines.__file__).parent
ALLOWED_OUTSIDE = {"pinrotate_core.errors", "pinrotate_core.log"}


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    package = ".".join(("pinrotate_core", *path.relative_to(ENGINES.parent).with_suffix("").parts[:-1]))
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            found.add(name)
    return found


def test_rooms_import_only_the_base_errors_log_and_themselves() -> None:
    problems = []
    for path in sorted(ENGINES.rglob("*.py")):
        room = path.relative_to(ENGINES).parts[0] if len(path.relative_to(ENGINES).parts) > 1 else None
        for name in imported_modules(path):
            if name.split(".")[0] == "prefect":
                problems.append(f"{path.name}: {name}")
            if not name.startswith("pinrotate_core.") or name in ALLOWED_OUTSIDE:
                continue
            if not name.startswith("pinrotate_core.engines"):
                problems.append(f"{path.relative_to(ENGINES)}: {name}")
            elif room and name.split(".")[2] not in ("base", room):
                problems.append(f"{path.relative_to(ENGINES)}: {name} (another room)")
            elif room in (None, "base") and name.split(".")[2:3] not in (["base"], []):
                problems.append(f"{path.relative_to(ENGINES)}: {name} (the base knows no room)")
    assert problems == []


def test_features_tell_the_two_engines_apart_where_callers_must_choose() -> None:
    mysql = ROOM.features
    assert (mysql.has_row_versions, POSTGRES_FEATURES.has_row_versions) == (False, True)
    assert mysql.has_skip_locked and POSTGRES_FEATURES.has_skip_locked
    assert not mysql.can_silence_triggers and POSTGRES_FEATURES.can_silence_triggers
    assert mysql.has_auto_updated_columns and not POSTGRES_FEATURES.has_auto_updated_columns
    assert mysql.schema_is_database and not POSTGRES_FEATURES.schema_is_database


def test_the_one_drain_and_its_pipeline_name_no_driver_no_room_and_no_engine_but_through_the_port() -> None:
    """One drain for both engines (drain/port.py): its loop, pipeline, guard protocol, options and
    results import no database driver and no room; what differs comes through a DrainPort
    (drain/pg_port.py, commands/mysql/drain_port.py). run.py's one exception: PostgreSQL's port as
    the default of ``drain_target``."""
    drain = ENGINES.parent / "drain"
    problems = []
    for name in ("run.py", "pipeline.py", "port.py", "guards.py", "options.py", "results.py", "heap.py"):
        for module in imported_modules(drain / name):
            driver = module.split(".")[0] in ("psycopg", "pymysql", "prefect")
            room = module.startswith("pinrotate_core.engines")
            if driver or room or (module == "pinrotate_core.drain.pg_port" and name != "run.py"):
                problems.append(f"{name}: {module}")
    assert problems == []
    import psycopg
    import pymysql

    from pinrotate_core.commands.mysql.drain_port import MYSQL_PORT
    from pinrotate_core.drain.pg_port import PG_PORT
    from pinrotate_core.drain.port import DrainPort

    ports: list[DrainPort] = [PG_PORT, MYSQL_PORT]  # mypy proves both complete
    assert [p.errors for p in ports] == [(psycopg.Error,), (pymysql.err.MySQLError,)]
