"""The discovery sweep: ciphertexts under a held key outside the configured targets (issue 22, point 6).

The gate sees configured columns; an archive table, a copy in another schema or a JSON field outside
``json_paths`` can still hold values under KEY. The sweep looks at every other column of every table,
partition and materialized view of the database: text, JSON and bytea columns for FPC1 (local keyrings)
or ``vault:v<N>:`` (Transit) values by key id, one scan per table for every key at once; bytea and
every candidate value of every other column by trying the keys on it (``sweep_trial``, nothing sampled),
and large objects. It reads in the gate's snapshot (``snapshot``), relations by identity. It reports names
and counts, never a value; it never writes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa

from ..config import Settings
from ..db import database_url, make_engine
from ..engines.postgresql.connect import describe_db_error
from ..engines.postgresql.snapshot import current_name, hold, one_moment
from ..errors import DatabaseError
from ..forge_discovery import with_forge_targets
from ..keyring import Keyring, is_version
from ..providers import build_provider
from .sweep_plan import plan_sweep
from .sweep_reads import FPC1_FIND, TRANSIT_FIND, Find, json_path_counts, pattern_counts
from .sweep_trial import TrialKeys, large_object_finds, trial_finds
from .verdict import GateReport


@dataclass
class Discovery:
    """What the sweep found, what it could not read (closes every gate), what it was told to skip."""

    server_side: bool
    finds: list[Find] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # schema.table -> one-line reason (blocks)
    unswept: dict[str, str] = field(default_factory=dict)  # schema.table -> why it cannot be searched (blocks)
    not_swept: dict[str, str] = field(default_factory=dict)  # schema.table[.column] -> discover_skip (never blocks)
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
        return {"OUTSIDE_TARGETS": outside, "UNREADABLE": len(self.unreadable), "UNSWEPT": len(self.unswept)}

    def as_dict(self, key: str | None = None) -> dict[str, Any]:
        """Every find (``key`` None: ``inventory --discover``), or the finds that block ``key``."""
        finds = self.finds if key is None else self.on_key(key)
        return {"discovered": [f.as_dict() for f in finds], "unreadable": dict(self.unreadable),
                "unswept": dict(self.unswept), "not_swept": dict(self.not_swept), "tables_swept": self.tables, "columns_swept": self.columns,
                "seconds": round(self.seconds, 3)}


def apply_discovery(report: GateReport, discovery: Discovery) -> None:
    """Close ``report`` on a find under its key or an unreadable table; keep the sweep's account in it."""
    for category, n in discovery.blocking(report.key).items():
        if n:  # only what blocks: the inventory's categories keep their shape
            report.blocking[category] = report.blocking.get(category, 0) + n
            report.open = False
    report.discovery = discovery.as_dict(report.key)


def sweep_database(conn: psycopg.Connection[Any], settings: Settings, keyring: Keyring,
                   key_ids: Sequence[str] | None = None) -> Discovery:
    """Sweep the database behind ``conn``, which must be inside the gate's snapshot (``snapshot.one_moment``):
    every relation is planned by oid in that snapshot, locked and checked to be the one planned
    (``snapshot.hold``), then read completely. ``key_ids``: the keys binary values are tried with (None:
    every key of the keyring); FPC1 / Transit key ids are counted for every key at once.

    A relation that cannot be read as planned (dropped, rewritten or renamed away meanwhile, locked by DDL,
    not readable by the role) is UNREADABLE; one that cannot be searched is UNSWEPT; both close every gate.
    """
    started = time.monotonic()
    discovery = Discovery(server_side=keyring.server_side)
    keys = None if keyring.server_side else TrialKeys(keyring, key_ids)
    try:
        plan = plan_sweep(conn, settings)
        discovery.unreadable, discovery.unswept = plan.unreadable, plan.unswept
        discovery.not_swept = plan.not_swept
        for table in plan.tables:
            reason = hold(conn, table.oid, table.label)
            if reason is not None:
                discovery.unreadable[table.label] = reason
                continue
            table.name_now = current_name(conn, table.oid)
            try:
                with conn.transaction():
                    found = pattern_counts(conn, table, keyring.server_side)
                    found.update(json_path_counts(conn, table, keyring.server_side))
                    discovery.finds += [Find(f"{table.label}.{name}", dict(counts), "pattern")
                                        for name, counts in found.items()]
                    if keys is not None:
                        discovery.finds += trial_finds(conn, table, keys)
            except (psycopg.errors.UndefinedTable, psycopg.errors.LockNotAvailable,
                    psycopg.errors.InsufficientPrivilege) as e:
                discovery.unreadable[table.label] = (f"cannot read {table.label} ({describe_db_error(e)}): the sweep "
                                                     "cannot see it; grant SELECT or list it in [gate] discover_skip")
                continue
            discovery.tables += 1
            discovery.columns += len(table.columns)
        pattern = re.compile((TRANSIT_FIND if keyring.server_side else FPC1_FIND).encode("ascii"))
        discovery.finds += large_object_finds(conn, keys, pattern, discovery.unreadable)
    except psycopg.Error as e:
        raise DatabaseError(f"the sweep outside the targets failed ({describe_db_error(e)})") from None
    discovery.seconds = time.monotonic() - started
    return discovery


def discover_outside_targets(engine: sa.Engine, settings: Settings, keyring: Keyring) -> Discovery:
    """The sweep in a snapshot of its own (``inventory --discover``)."""
    with one_moment(engine) as moment:
        return sweep_database(moment.conn, settings, keyring)


def discover(settings: Settings) -> Discovery:
    """``inventory --discover``: the sweep with the configured keyring and database."""
    keyring = build_provider(settings).load_keyring()
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        settings = with_forge_targets(settings, engine)  # Forge's own tables are targets, not finds
        return discover_outside_targets(engine, settings, keyring)
    finally:
        engine.dispose()


def outside_targets(report: GateReport) -> dict[str, list[str]]:
    """For the run's gate entry of a key: the columns holding values under it, the unreadable and unswept tables."""
    names = [f["column"] for f in report.discovery.get("discovered", [])]
    names += list(report.discovery.get("unreadable", {}))
    names += list(report.discovery.get("unswept", {}))
    return {"outside_targets": names} if names else {}
