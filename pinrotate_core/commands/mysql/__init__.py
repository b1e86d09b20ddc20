"""The commands on a MySQL / MariaDB URL (issue 32): each step through the module of this package
that decides it over the ``mysql`` room.

Every command is wired: the URL is accepted, the server is reached once at start
(``db.make_engine``: an unreachable server is exit 4 with one line naming database, address and
user; a server older than MariaDB 10.6 / MySQL 8.0 is exit 2); ``inventory`` (``.inventory``;
``--discover``: ``.sweep.discover_mysql``), ``gate --retire`` (``.gate``), ``run`` (the Prefect
flow, whose steps ask ``.run``: ``aesgcm``, ``fpc1`` and ``vault-transit``; its gate section
``.gate.run_gate``; its throttle ``MySqlThrottle``), ``grants`` (``.grants``), ``seed`` of both
samples (``.seed``), with pinrotate's own records (key check values, CONFLICTs) in the server's
``pinrotate`` database (``.bookkeeping``). ``keys`` never reads the database.

The engine room (``engines/mysql``) holds the SQL; the modules of this package (``commands/mysql/``)
hold the decisions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pymysql
import sqlalchemy as sa

from ...config import Settings, TargetSettings
from ...conflicts import StateError
from ...db import database_url, make_engine
from ...drain import DrainOptions, DrainResult, Shard
from ...engines.mysql.room import ROOM
from ...errors import DatabaseError, RefusedToStart
from ...gate.discover import Discovery
from ...gate.verdict import GateReport
from ...inventory import Inventory
from ...keyring import Keyring
from ...providers import KeyProvider
from ...schemes.base import Scheme
from ...throttle import Throttle, ThrottleControlSource
from ...throttle.mysql import MySqlThrottle
from ..base import EngineCommands, RecordConflicts, VerifySample
from . import gate, run, selection
from .bookkeeping import confirm_key_identity_mysql, ensure_conflicts_table_mysql, record_conflicts_mysql

if TYPE_CHECKING:
    from ...samples import forge_sample, pin_profile


class MySqlCommands:
    # -- a run's steps ----------------------------------------------------------------------------

    def make_throttle(self, engine: sa.Engine, settings: Settings, *, control: ThrottleControlSource | None,
                      run_id: str, writes: bool) -> Throttle:
        return MySqlThrottle.for_run(engine, settings, control=control, run_id=run_id, writes=writes)

    def confirm_key_identity(self, engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider,
                             *, record: bool, run_id: str | None, quiet: bool) -> None:
        # In the server's pinrotate database (.bookkeeping).
        with ROOM.raw_connection(engine) as my:
            confirm_key_identity_mysql(my, settings, keyring, provider, record=record, run_id=run_id, quiet=quiet)

    def resolve_targets(self, engine: sa.Engine, settings: Settings, targets: Sequence[TargetSettings],
                        keyring: Keyring, provider: KeyProvider, *, tenant: str | None, dry_run: bool,
                        into: dict[str, Scheme]) -> None:
        with ROOM.raw_connection(engine) as my:
            into.update(run.resolve_targets(my, settings, targets, keyring, provider, tenant=tenant))
            if not dry_run and any(s.guard == "cas" for s in into.values()):
                try:  # where this run records its CONFLICTs for the gate, made before the first write
                    ensure_conflicts_table_mysql(my)
                except StateError as e:
                    raise RefusedToStart(f"{e}; nothing was touched") from None

    def drain(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> DrainResult:
        return run.drain(engine, scheme, options)

    def plan_shards(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions, shards: int) -> list[Shard]:
        return selection.plan_shards(engine, scheme, options, shards)

    @contextlib.contextmanager
    def conflicts_recorder(self, engine: sa.Engine) -> Iterator[RecordConflicts]:
        # In the server's pinrotate database (.bookkeeping); the same rules as on PostgreSQL. The
        # driver's errors become DatabaseError here, at the boundary, as PostgreSQL's path raises.
        try:
            with ROOM.raw_connection(engine) as my:
                def record(target: str, by_tenant: Mapping[str, int], *, tenant_scope: str | None, complete: bool,
                           run_id: str) -> None:
                    record_conflicts_mysql(my, target, by_tenant, tenant_scope=tenant_scope, complete=complete,
                                           run_id=run_id)

                yield record
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"cannot record the CONFLICT counts ({ROOM.describe_db_error(e)})") from None

    @contextlib.contextmanager
    def verifier(self, engine: sa.Engine) -> Iterator[VerifySample]:
        # No connection held across targets: each sample is read on a connection of its own.
        yield lambda scheme, ids: run.verify_sample(engine, scheme, ids)

    def run_gate(self, engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
                 targets: Sequence[TargetSettings], tenant: str | None, failed: Mapping[str, int],
                 conflicts: Mapping[str, int], run_id: str) -> dict[str, Any]:
        return gate.run_gate(engine, settings, keyring, provider, targets=targets, tenant=tenant,
                             failed=failed, conflicts=conflicts, run_id=run_id)

    @contextlib.contextmanager
    def advisory_lock(self, engine: sa.Engine, name: str) -> Iterator[bool]:
        # GET_LOCK (server-wide), held by this connection's session.
        with ROOM.raw_connection(engine) as my, ROOM.lock.held(my, name) as held:
            yield held

    # -- the other commands -----------------------------------------------------------------------

    def inventory(self, settings: Settings, *, deep: bool, tenant: str | None) -> Inventory:
        from .inventory import mysql_inventory

        return mysql_inventory(settings, deep=deep, tenant=tenant)

    def discover(self, settings: Settings) -> Discovery:
        """The gate's sweep of the server, in a snapshot of its own."""
        from .sweep import discover_mysql

        return discover_mysql(settings)

    def retire_gate(self, settings: Settings, key: str, *, tenant: str | None, deep: bool,
                    erase_excluded: bool) -> GateReport:
        return gate.mysql_retire_gate(settings, key, tenant=tenant, deep=deep, erase_excluded=erase_excluded)

    def grant_statements(self, settings: Settings, role: str, *, read_only: bool) -> list[str]:
        from .grants import mysql_grant_statements

        return mysql_grant_statements(settings, role, read_only=read_only)

    def reach(self, settings: Settings) -> None:
        """Connect once and check the server's flavour and version (exit 4 / exit 2, one line)."""
        make_engine(database_url(settings), pool_size=1).dispose()

    def seed_pin_profile(self, settings: Settings, keyring: Keyring, *, rows: int,
                         key_id: str | None) -> pin_profile.SeedSummary:
        from .seed import seed_pin_profile_mysql  # examples/pin-profile-mysql.sql

        return seed_pin_profile_mysql(settings, keyring, rows=rows, key_id=key_id)

    def seed_forge(self, settings: Settings, bootstrap_file: Path, *, rows: int) -> forge_sample.ForgeSeedSummary:
        from .seed import seed_forge_mysql  # examples/forge-mysql.sql

        return seed_forge_mysql(settings, bootstrap_file, rows=rows)


MYSQL: EngineCommands = MySqlCommands()  # mypy proves here that the commands are complete
