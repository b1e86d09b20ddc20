"""What the discovery sweep reads: every table, partition and materialized view of the database, the
columns that can hold a ciphertext (every type with a text form that can carry one: strings, bytea, json,
xml, arrays, composites, ranges, hstore and other extension types), minus the configured targets' columns
and what ``[gate] discover_skip`` names; which of them the role cannot read (UNREADABLE) and which the sweep
cannot search (UNSWEPT: foreign tables, other sessions' temporary tables); both close every gate. Catalog
reads only, in the gate's snapshot: relations are planned by oid (``snapshot.hold`` then reads them by
identity).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Final, Literal

import psycopg
from psycopg import sql

from ..config import Settings
from ..targets import relation_of

SKIPPED_SCHEMAS: Final = ("pg_catalog", "information_schema", "pg_toast", "pinrotate")
Kind = Literal["text", "json", "bytea", "container"]
# Type categories whose values cannot carry a ciphertext: numbers (oids too), booleans, date/time,
# network addresses, geometry, bit strings, enums (labels are fixed by DDL).
NOT_CARRYING: Final = frozenset("NBDTIGVE")
NOT_CARRYING_TYPES: Final = frozenset({"uuid", "pg_lsn", "txid_snapshot", "pg_snapshot", "regclass", "oid"})


@dataclass(frozen=True)
class SweptColumn:
    name: str
    kind: Kind
    array: bool
    json_paths: tuple[str, ...] = ()  # a configured json column: swept outside these paths only

    @property
    def tried(self) -> bool:
        """Its values are tried with the held keys (binary ciphertexts), value by value."""
        return not self.json_paths


@dataclass
class SweptTable:
    schema: str
    table: str
    est_rows: float
    columns: list[SweptColumn] = field(default_factory=list)
    oid: int = 0
    # Its name now (``snapshot.current_name`` after ``snapshot.hold``): a rename after the snapshot is followed.
    name_now: sql.Composable | None = None

    @property
    def label(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def relation(self) -> sql.Composable:
        return self.name_now if self.name_now is not None else sql.Identifier(self.schema, self.table)


@dataclass
class _Rel:
    oid: int
    schema: str
    table: str
    relkind: str
    populated: bool
    usage: bool
    select: bool
    row_security: bool
    est_rows: float
    temp_of: str | None = None  # another session's temporary schema: whose
    columns: list[tuple[str, int, bool]] = field(default_factory=list)  # name, type oid, column SELECT


_CATALOG = """
SELECT c.oid, n.nspname::text, c.relname::text, c.relkind::text, c.relispopulated,
       has_schema_privilege(n.oid, 'USAGE'), has_table_privilege(c.oid, 'SELECT'),
       c.relkind = 'r' AND row_security_active(c.oid),
       GREATEST(c.reltuples, COALESCE(s.n_live_tup, 0))::float8,  -- never pg_relation_size: it takes a lock
       a.attname::text, a.atttypid, has_column_privilege(c.oid, a.attnum, 'SELECT'),
       n.nspname ~ '^pg_temp_' AND n.oid <> pg_my_temp_schema()
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_stat_all_tables s ON s.relid = c.oid
 WHERE c.relkind IN ('r', 'm', 'f') AND n.nspname <> ALL(%s) AND n.nspname !~ '^pg_toast_temp_'
   AND n.oid <> pg_my_temp_schema()
 ORDER BY 2, 3, a.attnum
"""


def _type_kinds(conn: psycopg.Connection[Any]) -> dict[int, tuple[Kind, bool]]:
    """Type oid -> (kind, is an array) for every type whose values can carry a ciphertext, domains
    resolved to their base. Containers (arrays, composites, ranges, xml, hstore, ...) are read through
    their text form: key ids by pattern, binary ciphertexts as the base64 / hex tokens in it."""
    rows = conn.execute("SELECT t.oid, t.typname::text, t.typtype::text, t.typcategory::text, t.typbasetype, "
                        "t.typelem, t.typnamespace = 'pg_catalog'::regnamespace FROM pg_type t "
                        "WHERE t.typtype IN ('b', 'd', 'c', 'r', 'm')").fetchall()
    types = {int(r[0]): r for r in rows}

    def kind(oid: int, depth: int = 0) -> tuple[Kind, bool] | None:
        row = types.get(oid)
        if row is None or depth > 16:
            return None
        _, name, typtype, category, base, elem, builtin = row
        if typtype == "d":
            return kind(int(base), depth + 1)
        if category == "A":
            inner = kind(int(elem), depth + 1)
            return ("container", True) if inner else None
        if builtin and name == "bytea":
            return "bytea", False
        if builtin and name in ("json", "jsonb"):
            return "json", False
        if category == "S":
            return "text", False
        if typtype in ("c", "r", "m"):
            return "container", False
        if category in NOT_CARRYING or (builtin and name in NOT_CARRYING_TYPES) or category == "P":
            return None
        return "container", False

    out: dict[int, tuple[Kind, bool]] = {}
    for oid in types:
        found = kind(oid)
        if found is not None:
            out[oid] = found
    return out


def _configured(conn: psycopg.Connection[Any], settings: Settings) -> dict[tuple[int, str], tuple[str, ...]]:
    """(table oid, column) of every configured cipher column -> its json_paths (empty: the whole column)."""
    out: dict[tuple[int, str], tuple[str, ...]] = {}
    for t in settings.targets:
        row = conn.execute("SELECT to_regclass(%s)::oid", (relation_of(t).as_string(conn),)).fetchone()
        if row is None or row[0] is None:
            continue  # a missing table is BLOCKED in the inventory: the gate is closed anyway
        for column in t.columns:
            out[(int(row[0]), column)] = tuple(t.json_paths.get(column, ()))
    return out


def _ancestors(conn: psycopg.Connection[Any]) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Every relation's parents (partitions and inheritance children are read through their parents), and
    the parents' names (``discover_skip`` of a partitioned table covers its partitions)."""
    parents: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    # A partition being detached (DETACH ... CONCURRENTLY left pending) is not read through its parent
    # any more: it is swept on its own.
    pending = "i.inhdetachpending" if conn.info.server_version >= 140000 else "false"
    for child, parent, name in conn.execute(
            "SELECT i.inhrelid, i.inhparent, n.nspname::text || '.' || c.relname::text FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhparent JOIN pg_namespace n ON n.oid = c.relnamespace "
            f"WHERE NOT {pending}").fetchall():
        parents.setdefault(int(child), []).append(int(parent))
        names[int(parent)] = str(name)
    return parents, names


def _lineage(oid: int, parents: dict[int, list[int]]) -> Iterator[int]:
    seen: set[int] = set()
    todo = [oid]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            yield current
            todo.extend(parents.get(current, []))


@dataclass
class SweepPlan:
    tables: list[SweptTable] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # schema.table -> one-line reason
    unswept: dict[str, str] = field(default_factory=dict)  # schema.table -> why it cannot be searched (blocks)
    not_swept: dict[str, str] = field(default_factory=dict)  # schema.table[.column] -> discover_skip (never blocks)


def plan_sweep(conn: psycopg.Connection[Any], settings: Settings) -> SweepPlan:
    """The tables and columns to sweep, the ones skipped (and why) and the ones the role cannot read.

    A table the role cannot read in full (no USAGE on its schema, no SELECT on a swept column, row-level
    security that applies to the role) is unreadable: something could hide there, every gate stays closed.
    """
    kinds = _type_kinds(conn)
    configured = _configured(conn, settings)
    parents, parent_names = _ancestors(conn)
    skip = settings.gate.discover_skip
    plan = SweepPlan()
    rels: dict[int, _Rel] = {}
    sessions = temp_sessions(conn)
    unnamed = ("its session cannot be named before PostgreSQL 16" if conn.info.server_version < 160000
               else "no live session: left by a crash")
    for (oid, schema, table, relkind, populated, usage, select, rls, est, column, typid,
         column_select, other_temp) in conn.execute(_CATALOG, (list(SKIPPED_SCHEMAS),)).fetchall():
        rel = rels.get(int(oid))
        if rel is None:
            rel = rels[int(oid)] = _Rel(int(oid), schema, table, relkind, bool(populated), bool(usage),
                                        bool(select), bool(rls), float(est),
                                        sessions.get(schema, unnamed) if other_temp else None)
        rel.columns.append((column, int(typid), bool(column_select)))
    for rel in rels.values():
        swept = SweptTable(rel.schema, rel.table, rel.est_rows, oid=rel.oid)
        lineage = list(_lineage(rel.oid, parents))
        names = [swept.label, *(parent_names[o] for o in lineage[1:] if o in parent_names)]
        skipped_as = next((n for n in names if any(fnmatchcase(n, p) for p in skip if p.count(".") == 1)), None)
        if skipped_as is not None:
            if any(int(typid) in kinds for _, typid, _ in rel.columns):
                plan.not_swept[swept.label] = "[gate] discover_skip" + (
                    f" (through {skipped_as})" if skipped_as != swept.label else "")
            continue
        unreadable_columns = False
        for name, typid, column_select in rel.columns:
            found = kinds.get(typid)
            if found is None:
                continue
            paths: tuple[str, ...] = ()
            covered = [configured[(o, name)] for o in lineage if (o, name) in configured]
            if covered:
                paths = covered[0]
                if not paths:
                    continue  # a configured cipher column: the inventory counts it
            label = f"{swept.label}.{name}"
            if any(fnmatchcase(label, p) for p in skip if p.count(".") == 2):
                plan.not_swept[label] = "[gate] discover_skip"
                continue
            unreadable_columns |= not (rel.select or column_select)
            swept.columns.append(SweptColumn(name, found[0], found[1], paths))
        if not swept.columns:
            continue
        if rel.temp_of is not None:
            plan.unswept[swept.label] = (f"temporary table of another session ({rel.temp_of}): no other session "
                                         "can read it; end that session, or list it in [gate] discover_skip")
        elif rel.relkind == "f":
            plan.unswept[swept.label] = ("foreign table: its rows live on another server, the sweep cannot search "
                                         "them; list it in [gate] discover_skip once that server is checked")
        elif rel.relkind == "m" and not rel.populated:
            plan.not_swept[swept.label] = "materialized view not populated: it holds no rows"
        elif not rel.usage or unreadable_columns:
            plan.unreadable[swept.label] = (f"cannot read {swept.label}: the sweep cannot see it; "
                                            "grant SELECT or list it in [gate] discover_skip")
        elif rel.row_security:
            plan.unreadable[swept.label] = (f"cannot read every row of {swept.label}: row-level security "
                                            "applies to this role; use a role with BYPASSRLS or list it "
                                            "in [gate] discover_skip")
        else:
            plan.tables.append(swept)
    return plan


def temp_sessions(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """Temporary schema name -> the session that owns it (pid and application_name; never what it runs).

    PostgreSQL 16+ numbers a temporary schema by its backend id, which ``pg_stat_get_backend_idset`` gives;
    before 16 that id is not visible, and the schema is named alone."""
    if conn.info.server_version < 160000:
        return {}
    rows = conn.execute("SELECT 'pg_temp_' || b.id, pg_stat_get_backend_pid(b.id), coalesce(a.application_name, '') "
                        "FROM pg_stat_get_backend_idset() AS b(id) "
                        "LEFT JOIN pg_stat_activity a ON a.pid = pg_stat_get_backend_pid(b.id)").fetchall()
    return {str(name): f"pid {pid}, application_name {str(app)!r}" for name, pid, app in rows}
