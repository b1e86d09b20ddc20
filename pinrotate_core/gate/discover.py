"""The discovery sweep: ciphertexts under a held key outside the configured targets (issue 22, point 6).

The gate sees configured columns; an archive table, a copy in another schema or a JSON field outside
``json_paths`` can still hold values under KEY. The sweep looks at every other column of every table,
partition and materialized view of the database: text, JSON and bytea columns for FPC1 (local keyrings)
or ``vault:v<N>:`` (Transit) values by key id, one scan per table for every key at once; bytea and
base64 text columns by trying the held keys on a bounded sample. It reports names and counts, never a
value; it never writes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ..config import Settings
from ..db import database_url, describe_db_error, make_engine, raw_connection
from ..errors import DatabaseError
from ..forge_discovery import with_forge_targets
from ..keyring import Keyring, is_version
from ..log import log_event
from ..providers import build_provider
from .sweep_plan import plan_sweep
from .sweep_reads import Find, SampleKeys, json_path_counts, pattern_counts, sample_finds
from .verdict import GateReport

LOCK_TIMEOUT: Final = "5s"  # a table locked by DDL longer than this is reported unreadable: closed


@dataclass
class Discovery:
    """What the sweep found, what it could not read (closes every gate), what it was told to skip."""

    server_side: bool
    finds: list[Find] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # schema.table -> one-line reason
    not_swept: dict[str, str] = field(default_factory=dict)  # schema.table[.column] -> why (never blocks)
    tables: int = 0
    columns: int = 0
    seconds: float = 0.0

    def blocks(self, found: str, key: str) -> bool:
        """Does a value on ``found`` keep ``key`` from being destroyed? Transit: retiring N retires every M <= N."""
        if self.server_side:
            return is_version(found) and is_version(key) and int(found) <= int(key)
        return found == key

    def on_key(self, key: str) -> list[Find]:
        return [f for f in self.finds if any(self.blocks(k, key) for k in f.by_key)]

    def blocking(self, key: str) -> dict[str, int]:
        outside = sum(n for f in self.finds for k, n in f.by_key.items() if self.blocks(k, key))
        return {"OUTSIDE_TARGETS": outside, "UNREADABLE": len(self.unreadable)}

    def as_dict(self, key: str | None = None) -> dict[str, Any]:
        """Every find (``key`` None: ``inventory --discover``), or the finds that block ``key``."""
        finds = self.finds if key is None else self.on_key(key)
        return {"discovered": [f.as_dict() for f in finds], "unreadable": dict(self.unreadable),
                "not_swept": dict(self.not_swept), "tables_swept": self.tables, "columns_swept": self.columns,
                "seconds": round(self.seconds, 3)}


def apply_discovery(report: GateReport, discovery: Discovery) -> None:
    """Close ``report`` on a find under its key or an unreadable table; keep the sweep's account in it."""
    for category, n in discovery.blocking(report.key).items():
        if n:  # only what blocks: the inventory's categories keep their shape
            report.blocking[category] = report.blocking.get(category, 0) + n
            report.open = False
    report.discovery = discovery.as_dict(report.key)


def sweep_database(conn: psycopg.Connection[Any], settings: Settings, keyring: Keyring) -> Discovery:
    """Sweep the database behind ``conn`` (each table read, and locked, in a transaction of its own).

    A table dropped meanwhile is gone (nothing to find); one locked by DDL past ``LOCK_TIMEOUT``, or one the
    role turns out not to read, is unreadable (closes every gate). Other database errors: DatabaseError.
    """
    started = time.monotonic()
    discovery = Discovery(server_side=keyring.server_side)
    keys = None if keyring.server_side else SampleKeys(keyring)
    set_lock_timeout = sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT))
    try:
        plan = plan_sweep(conn, settings)
        discovery.unreadable, discovery.not_swept = plan.unreadable, plan.not_swept
        for table in plan.tables:
            try:
                # One transaction a table, its lock_timeout with it (SET LOCAL: behind a transaction
                # pooler nothing pinrotate sets may outlive its transaction).
                with conn.transaction():
                    conn.execute(set_lock_timeout)
                    found = pattern_counts(conn, table, keyring.server_side)
                    found.update(json_path_counts(conn, table, keyring.server_side))
                    discovery.finds += [Find(f"{table.label}.{name}", dict(counts), "pattern")
                                        for name, counts in found.items()]
                    if keys is not None:
                        discovery.finds += sample_finds(conn, table, keys, settings.gate.discover_sample)
            except psycopg.errors.UndefinedTable:
                continue
            except (psycopg.errors.LockNotAvailable, psycopg.errors.InsufficientPrivilege) as e:
                discovery.unreadable[table.label] = (f"cannot read {table.label} ({describe_db_error(e)}): the sweep "
                                                     "cannot see it; grant SELECT or list it in [gate] discover_skip")
                continue
            discovery.tables += 1
            discovery.columns += len(table.columns)
    except psycopg.Error as e:
        raise DatabaseError(f"the sweep outside the targets failed ({describe_db_error(e)})") from None
    discovery.seconds = time.monotonic() - started
    return discovery


def discover_outside_targets(engine: sa.Engine, settings: Settings, keyring: Keyring) -> Discovery:
    """The sweep on a connection of its own."""
    with raw_connection(engine) as conn:
        return sweep_database(conn, settings, keyring)


def discover(settings: Settings) -> Discovery:
    """``inventory --discover``: the sweep with the configured keyring and database."""
    keyring = build_provider(settings).load_keyring()
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        settings = with_forge_targets(settings, engine)  # Forge's own tables are targets, not finds
        return discover_outside_targets(engine, settings, keyring)
    finally:
        engine.dispose()


def sweep_for_run(engine: sa.Engine, settings: Settings, keyring: Keyring, verdicts: Mapping[str, GateReport],
                  run_id: str) -> None:
    """The run's gate: one sweep for every older key at once, only when some key would otherwise be open
    (the sweep can only close a gate). A sweep that fails closes every key, with the reason logged."""
    if not any(report.open for report in verdicts.values()):
        return
    try:
        discovery = discover_outside_targets(engine, settings, keyring)
    except DatabaseError as e:
        log_event("gate_sweep_failed", level=40, run_id=run_id, error=str(e))
        for report in verdicts.values():
            report.open = False
            report.blocking["UNSWEPT"] = 1
        return
    for report in verdicts.values():
        apply_discovery(report, discovery)


def outside_targets(report: GateReport) -> dict[str, list[str]]:
    """For the run's gate entry of a key: the columns holding values under it and the unreadable tables."""
    names = [f["column"] for f in report.discovery.get("discovered", [])]
    names += list(report.discovery.get("unreadable", {}))
    return {"outside_targets": names} if names else {}
