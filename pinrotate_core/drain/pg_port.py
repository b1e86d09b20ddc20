"""The drain's port on PostgreSQL (``port.DrainPort``): psycopg connections from the engine's
pool, each batch's read and write in a transaction of its own bounded by ``SET LOCAL``s
(``transaction_settings``), the write guards of ``guard_version`` / ``guard_cas`` over the SQL of
``selection`` and ``counting``, the ``fpc1`` pre-pass of ``fpc1_precheck``, worker bounds from
``shards``, and one synchronous commit as the durability barrier (batches commit with
``synchronous_commit = off``)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ..engines.postgresql.connect import describe_db_error, raw_connection, read_only_when
from ..engines.postgresql.durability import force_flush
from ..engines.postgresql.session import batch_settings
from ..schemes.base import Scheme
from ..targets import ResolvedTarget, writing_batch_begin
from .counting import BacklogCounter
from .fpc1_precheck import HoldsFailingKeys, hold_failing_keys
from .guard_cas import CasGuard
from .guard_version import VersionGuard
from .guards import Guard
from .options import DrainOptions
from .port import CommitLost
from .results import Tally
from .selection import Selection
from .shards import ShardPlanner

# The write guard of each scheme's ``guard``: the one place that names them.
GUARDS: dict[str, type[VersionGuard | CasGuard]] = {"version": VersionGuard, "cas": CasGuard}


def transaction_settings(options: DrainOptions) -> list[sql.Composable]:
    """The ``SET LOCAL``s of every transaction of a drain (its reads and its writes): the room's
    ``batch_settings`` for these options."""
    return list(_settings(options.lock_timeout, options.statement_timeout, options.idle_timeout, options.dry_run))


@functools.lru_cache(maxsize=64)
def _settings(lock_timeout: float, statement_timeout: float, idle_timeout: float,
              dry_run: bool) -> tuple[sql.Composable, ...]:
    """``batch_settings``, composed once per set of limits rather than once a batch."""
    return tuple(batch_settings(lock_timeout, statement_timeout, idle_timeout, dry_run=dry_run))


@functools.lru_cache(maxsize=64)
def _read_begin(lock_timeout: float, statement_timeout: float, idle_timeout: float, dry_run: bool) -> sql.Composed:
    """A batch read's BEGIN with its ``SET LOCAL``s, in one round trip."""
    return sql.SQL("; ").join([
        sql.SQL("BEGIN ISOLATION LEVEL READ COMMITTED" + (" READ ONLY" if dry_run else "")),
        *_settings(lock_timeout, statement_timeout, idle_timeout, dry_run)])


class PgDrainParts:
    def __init__(self, scheme: Scheme, options: DrainOptions) -> None:
        self.scheme = scheme
        self.options = options
        self.selection = selection = Selection(scheme, options.tenant)
        self.guard: Guard = GUARDS[scheme.guard](scheme, selection, options.dry_run)
        self.counter = BacklogCounter(scheme, selection, options.id_range)
        self.planner = ShardPlanner(selection, options.id_range, options.run_id)

    def prepare(self, conn: psycopg.Connection[Any]) -> None:
        return None  # the guards compose their statements from the resolved target

    def count_backlog(self, conn: psycopg.Connection[Any]) -> int:
        return self.counter.count_backlog(conn)

    def hold_failing_keys(self, conn: psycopg.Connection[Any], tally: Tally) -> None:
        if isinstance(self.scheme, HoldsFailingKeys):  # no integrity: check first
            hold_failing_keys(conn, self.scheme, self.selection, self.options.id_range, tally, self.options.run_id)

    def range_bounds(self, conn: psycopg.Connection[Any], workers: int, backlog: int) -> list[Any]:
        return self.planner.range_bounds(conn, workers, backlog)


class PgDrainPort:
    errors: tuple[type[BaseException], ...] = (psycopg.Error,)
    lock_retry_errors: tuple[type[BaseException], ...] = (
        psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)
    serialization_errors: tuple[type[BaseException], ...] = (psycopg.errors.SerializationFailure,)

    @staticmethod
    def describe_error(exc: BaseException | None) -> str:
        return describe_db_error(exc)

    @staticmethod
    def parts(engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> PgDrainParts:
        return PgDrainParts(scheme, options)

    @staticmethod
    def connect(engine: sa.Engine) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        return raw_connection(engine)

    @staticmethod
    def reading(conn: psycopg.Connection[Any], dry_run: bool) -> contextlib.AbstractContextManager[None]:
        return read_only_when(conn, dry_run)

    @staticmethod
    def begin_read(conn: psycopg.Connection[Any], options: DrainOptions) -> None:
        # No row lock; its own short transaction, whose SET LOCALs bound it (transaction_settings).
        conn.execute(_read_begin(options.lock_timeout, options.statement_timeout, options.idle_timeout,
                                 options.dry_run))

    @staticmethod
    def end_read(conn: psycopg.Connection[Any], ok: bool) -> None:
        if ok:
            conn.execute("COMMIT")
        else:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")

    @staticmethod
    def begin_write(conn: psycopg.Connection[Any], target: ResolvedTarget, options: DrainOptions,
                    wait: float | None) -> None:
        settings = _settings(options.lock_timeout, options.statement_timeout, options.idle_timeout, options.dry_run)
        conn.execute(writing_batch_begin(target, wait, settings))  # one round trip

    @staticmethod
    def commit(conn: psycopg.Connection[Any]) -> None:
        try:
            conn.execute("COMMIT")
        except psycopg.Error as e:
            if not (conn.closed or conn.broken):
                raise  # the server answered: rolled back
            raise CommitLost(describe_db_error(e)) from None

    @staticmethod
    def rollback(conn: psycopg.Connection[Any]) -> None:
        with contextlib.suppress(psycopg.Error):
            conn.execute("ROLLBACK")

    @staticmethod
    def make_durable(conn: psycopg.Connection[Any]) -> None:
        # Batches commit with synchronous_commit = off: one synchronous commit flushes the WAL
        # behind every one of them, so a crash cannot undo what this drain reports.
        force_flush(conn)


PG_PORT = PgDrainPort()

