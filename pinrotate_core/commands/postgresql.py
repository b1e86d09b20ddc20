"""The commands on a PostgreSQL URL (and the embedded server): the core's own paths, as they were
before the commands were split by engine (``drain``, ``gate``, ``inventory``, ``key_checks``,
``conflicts``, ``grants``, ``samples``, the ``postgresql`` room's advisory lock)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from .. import scheme_sql
from ..config import Settings, TargetSettings
from ..conflicts import StateError, ensure_conflicts_table, record_conflicts
from ..db import describe_db_error, raw_connection
from ..drain import DrainOptions, DrainResult, Shard, drain_target, split_backlog
from ..engines.postgresql.room import ROOM
from ..errors import ConfigError, DatabaseError, RefusedToStart, TargetBlocked
from ..gate import retire_gate, run_gate
from ..gate.discover import Discovery, discover
from ..gate.verdict import GateReport
from ..grants import grant_statements
from ..inventory import Inventory, capacity_blocker, take_inventory
from ..key_checks import confirm_key_identity
from ..keyring import Keyring
from ..providers import KeyProvider
from ..reading_start import start_reading
from ..schemes.base import Scheme
from ..schemes.registry import build_scheme, reads_row_versions
from ..targets import resolve_target
from ..throttle import Throttle, ThrottleControlSource
from .base import EngineCommands, RecordConflicts, VerifySample, count_read_back

if TYPE_CHECKING:
    from ..samples import forge_sample, pin_profile


class PostgresCommands:
    # -- a run's steps ----------------------------------------------------------------------------

    def make_throttle(self, engine: sa.Engine, settings: Settings, *, control: ThrottleControlSource | None,
                      run_id: str, writes: bool) -> Throttle:
        return Throttle.from_settings(engine, settings, control=control, run_id=run_id)

    def confirm_key_identity(self, engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider,
                             *, record: bool, run_id: str | None, quiet: bool) -> None:
        confirm_key_identity(engine, settings, keyring, provider, record=record, run_id=run_id, quiet=quiet)

    def resolve_targets(self, engine: sa.Engine, settings: Settings, targets: Sequence[TargetSettings],
                        keyring: Keyring, provider: KeyProvider, *, tenant: str | None, dry_run: bool,
                        into: dict[str, Scheme]) -> None:
        try:
            with raw_connection(engine) as conn:
                for t in targets:
                    resolved = resolve_target(conn, t, reads_versions=reads_row_versions(t.format))
                    scheme = build_scheme(resolved, keyring, settings.keys, provider)
                    # Room for the new ciphertexts: a column too narrow is BLOCKED, never widened.
                    reason = capacity_blocker(conn, scheme, tenant)
                    if reason is not None:
                        raise TargetBlocked(t.name, reason)
                    into[t.name] = scheme
                if not dry_run and any(s.guard == "cas" for s in into.values()):
                    # Where this run records its CONFLICTs for the gate, made before the first write:
                    # a role that may not create it is refused here, with nothing written.
                    ensure_conflicts_table(conn)
        except StateError as e:
            raise RefusedToStart(f"{e}; nothing was touched") from None
        except TargetBlocked as e:
            raise ConfigError(f"{e}; nothing was touched") from None
        except psycopg.Error as e:
            raise DatabaseError(f"cannot resolve the targets ({describe_db_error(e)})") from None

    def drain(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> DrainResult:
        return drain_target(engine, scheme, options)

    def plan_shards(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions, shards: int) -> list[Shard]:
        return split_backlog(engine, scheme, options, shards)

    @contextlib.contextmanager
    def conflicts_recorder(self, engine: sa.Engine) -> Iterator[RecordConflicts]:
        with raw_connection(engine) as conn:
            def record(target: str, by_tenant: Mapping[str, int], *, tenant_scope: str | None, complete: bool,
                       run_id: str) -> None:
                record_conflicts(conn, target, by_tenant, tenant_scope=tenant_scope, complete=complete, run_id=run_id)

            yield record

    @contextlib.contextmanager
    def verifier(self, engine: sa.Engine) -> Iterator[VerifySample]:
        with raw_connection(engine) as conn:
            yield lambda scheme, ids: _verify_sample(conn, scheme, ids)

    def run_gate(self, engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
                 targets: Sequence[TargetSettings], tenant: str | None, failed: Mapping[str, int],
                 conflicts: Mapping[str, int], run_id: str) -> dict[str, Any]:
        return run_gate(engine, settings, keyring, provider, targets=targets, tenant=tenant, failed=failed,
                        conflicts=conflicts, run_id=run_id)

    @contextlib.contextmanager
    def advisory_lock(self, engine: sa.Engine, name: str) -> Iterator[bool]:
        # pg_try_advisory_lock (per database), held by this connection's session.
        with ROOM.raw_connection(engine) as conn, ROOM.lock.held(conn, name) as held:
            yield held

    # -- the other commands -----------------------------------------------------------------------

    def inventory(self, settings: Settings, *, deep: bool, tenant: str | None) -> Inventory:
        start = start_reading(settings, tenant, pool_size=2)
        try:
            return take_inventory(start.engine, start.settings, start.keyring, deep=deep, tenant=tenant,
                                  provider=start.provider)
        finally:
            start.engine.dispose()

    def discover(self, settings: Settings) -> Discovery:
        return discover(settings)

    def retire_gate(self, settings: Settings, key: str, *, tenant: str | None, deep: bool,
                    erase_excluded: bool) -> GateReport:
        return retire_gate(settings, key, tenant=tenant, deep=deep, erase_excluded=erase_excluded)

    def grant_statements(self, settings: Settings, role: str, *, read_only: bool) -> list[str]:
        return grant_statements(settings, role, read_only=read_only)

    def reach(self, settings: Settings) -> None:
        """Nothing: the seed reaches the server itself (after the keyring, as it always has)."""

    def seed_pin_profile(self, settings: Settings, keyring: Keyring, *, rows: int,
                         key_id: str | None) -> pin_profile.SeedSummary:
        from ..samples import seed_database

        return seed_database(settings, keyring, rows=rows, key_id=key_id)

    def seed_forge(self, settings: Settings, bootstrap_file: Path, *, rows: int) -> forge_sample.ForgeSeedSummary:
        from ..samples import seed_forge_sample

        return seed_forge_sample(settings, bootstrap_file, rows=rows)


def _verify_sample(conn: psycopg.Connection[Any], scheme: Scheme, ids: Sequence[Any]) -> tuple[int, int]:
    """Re-read rows this run committed and decrypt every value (as ``inventory --deep`` does)."""
    target = scheme.target
    query = sql.SQL("SELECT {id}, {cols} FROM {rel} WHERE {id} = ANY(%s)").format(
        cols=sql.SQL(", ").join(scheme_sql.read_list(scheme)), rel=target.relation, id=sql.Identifier(target.settings.id))
    return count_read_back(scheme, conn.cursor(binary=True).execute(query, [list(ids)]).fetchall())


POSTGRESQL: EngineCommands = PostgresCommands()  # mypy proves here that the commands are complete
