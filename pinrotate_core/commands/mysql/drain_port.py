"""The drain's port on MySQL / MariaDB (``drain.port.DrainPort``): the one drain and batch pipeline
of ``drain/`` over PyMySQL connections, every scheme written by compare-and-swap (there is no
``xmin``).

- Connections: the engine's pool, each known to the row-lock watch (``drain_session``).
- Reads: without row locks, each in autocommit (one statement; InnoDB reads a consistent view).
- Writes: one transaction per batch (``start_batch``: READ COMMITTED, ``innodb_lock_wait_timeout``
  from ``job.lock_timeout``, on MariaDB ``max_statement_time`` and ``idle_transaction_timeout``;
  the limits reset when it ends), through the room's ``MySqlCasGuard``: rows the application holds
  are skipped (``SKIP LOCKED``, never waited on), a row whose values are no longer the ones read is
  not written (exact bytes; ``fpc1``: a CONFLICT unless another run moved it meanwhile, same
  plaintext on the active key, ``settled_elsewhere``; other schemes: left for the next run),
  ``ON UPDATE CURRENT_TIMESTAMP`` columns keep their value, and what the server stored is read
  back and compared before COMMIT (a row that stored something else, a trigger's doing, rolls the
  batch back and is FAILED ``not_stored``; the batch is written again without it).
- A connection lost during the COMMIT itself is an unknown outcome, never a rollback.
- ``fpc1`` first decrypts every stale value of the whole target once, every tenant and every
  shard's ids: a key any value of which fails is held back for the whole run.
- The CONFLICTs of an ``fpc1`` drain go to the server's ``pinrotate`` database for the gate.
- No durability barrier: a COMMIT is as durable as the server's settings make it, which the gate
  checks (``innodb_flush_log_at_trx_commit``, ``sync_binlog``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import pymysql
import sqlalchemy as sa

from ...conflicts import StateError
from ...drain.fpc1_precheck import HoldsFailingKeys, hold_keys_failing_in
from ...drain.guards import Guard, Sweep
from ...drain.options import DrainOptions
from ...drain.port import CommitLost
from ...drain.results import CONFLICTS_UNRECORDED, BatchOutcome, DrainResult, NotStoredRows, Tally
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql.connect import MySqlConnection
from ...engines.mysql.guard import CasRow, CommitOutcomeUnknown, MySqlCasGuard, commit_batch, end_batch, start_batch
from ...engines.mysql.signals import drain_session
from ...schemes.base import BatchPlan, Scheme
from ...schemes.fpc1 import Fpc1Scheme
from ...targets import ResolvedTarget
from .bookkeeping import record_conflicts_mysql, tenant_key
from .selection import count_backlog, range_bounds, read_batch, rows_in_scope, stale_rows, stale_where
from .targets import read_table


class MySqlRowGuard:
    """The drain's write guard on MySQL / MariaDB: a row's stale columns and its key version are
    written whole, in one compare-and-swap on every value read (``MySqlCasGuard``)."""

    row_wait: float | None = None  # never waits on a row: SKIP LOCKED

    def __init__(self, scheme: Scheme, options: DrainOptions) -> None:
        self.scheme = scheme
        self.options = options
        self.target = scheme.target
        self.cas: MySqlCasGuard | None = None  # the room's statements, once the table is read (``prepare``)

    def prepare(self, conn: MySqlConnection) -> None:
        t = self.target.settings
        kv = self.target.key_version if t.format != "fpc1" else None
        table = read_table(conn, t, writing=not self.options.dry_run)
        self.cas = MySqlCasGuard(table, t.id, [*(c.name for c in self.target.columns), *([kv.name] if kv else [])],
                                 stale_where=stale_where(self.scheme, self.options.tenant))

    def read(self, conn: MySqlConnection, lo: Any, hi: Any, size: int) -> list[tuple[Any, ...]]:
        return read_batch(conn, self.scheme, self.options.tenant, lo, hi, size)

    @staticmethod
    def after(row: tuple[Any, ...]) -> Any:
        return row[0]

    @staticmethod
    def received(rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], Any]:
        return rows, {row[0]: row for row in rows}  # (id, tenant or key version, values...) as read

    def write_batch(self, conn: MySqlConnection, plan: BatchPlan, outcome: BatchOutcome,
                    versions: dict[Any, tuple[Any, ...]], cautious: bool) -> None:
        """Every row of the plan in one compare-and-swap: its columns the plan writes set, the others
        as read, the key version (if any) moved to the current key; compared with every value read."""
        assert self.cas is not None, "prepare() reads the table first"
        ciphers = [c.name for c in self.target.columns]
        kv = self.target.settings.format != "fpc1" and self.target.key_version is not None
        new: dict[Any, list[Any]] = {}
        weight: dict[Any, int] = {}
        columns: dict[Any, list[str]] = {}
        for w in plan.writes:
            for j, row_id in enumerate(w.ids):
                values = new.setdefault(row_id, list(versions[row_id][2:]))
                for k, column in enumerate(w.columns):
                    values[column] = w.new[k][j]
                    columns.setdefault(row_id, []).append(ciphers[column])
                weight[row_id] = weight.get(row_id, 0) + (w.weights[j] if j < len(w.weights) else 1)
        if not new:
            return
        current = [int(self.scheme.current_key)] if kv else []
        rows = [CasRow(row_id, (*versions[row_id][2:], *([versions[row_id][1]] if kv else [])), (*values, *current))
                for row_id, values in new.items()]
        cas = self.cas.write(conn, rows)
        if cas.mismatched:  # the server stored something else: roll back, write again without them
            raise NotStoredRows(cas.mismatched)
        outcome.reencrypted += sum(weight[i] for i in cas.written)
        outcome.held += cas.skipped  # held by the application: for the sweep
        if self.target.settings.format != "fpc1":
            outcome.changed += len(cas.changed)  # an application's edit: left for the next run
            return
        settled = self._settled_elsewhere(conn, versions, cas.changed)
        for row_id in cas.changed:  # CONFLICT: an fpc1 value changed between read and write (contract §6)
            if row_id in settled:  # moved by another run meanwhile: done, not a CONFLICT
                outcome.settled += weight[row_id]
                continue
            outcome.conflicts += weight[row_id]
            outcome.lost.append((row_id, ",".join(dict.fromkeys(columns[row_id])), tenant_key(versions[row_id][1]),
                                 weight[row_id]))

    def _settled_elsewhere(self, conn: MySqlConnection, read: dict[Any, tuple[Any, ...]],
                           changed: Sequence[Any]) -> set[Any]:
        """The rows not written because they changed since they were read whose values another run
        moved meanwhile (on the active key, the same plaintext, nothing else changed:
        ``Fpc1Scheme.settled``), as ``drain.guard_cas`` settles its misses on PostgreSQL. An
        application's edit, or a row gone or out of scope, stays a CONFLICT."""
        scheme = self.scheme
        if not changed or not isinstance(scheme, Fpc1Scheme):
            return set()
        columns = scheme.target.columns
        now = rows_in_scope(conn, scheme, self.options.tenant, changed)
        return {row_id for row_id, row in now.items()
                if all(n == r or scheme.settled(c, r, n) for c, r, n in zip(columns, read[row_id][2:], row[2:],
                                                                               strict=True))
                and row[2:] != read[row_id][2:]}

    @staticmethod
    def next_sweep(engine: sa.Engine, counter: Any, tally: Tally) -> Sweep:
        """Only the rows an application held locked at the write are tried again."""
        held = tally.take_held()
        return Sweep(due=bool(held), only=held)

    def record_conflicts(self, conn: MySqlConnection | None, result: DrainResult, options: DrainOptions) -> None:
        """After a non-dry drain of an ``fpc1`` target: its CONFLICTs in ``pinrotate.conflicts`` for the
        gate. A shard (an id range) adds its own and clears nothing (``rotation.record_run_conflicts``
        records the run's total once all have ended). A failure, or no connection, leaves the drain
        fail-closed (``state_error``: exit 4)."""
        if options.dry_run or self.scheme.guard != "cas":
            return
        if conn is None:
            result.state_error = CONFLICTS_UNRECORDED
            return
        try:
            record_conflicts_mysql(conn, result.target, result.conflicts_by_tenant, tenant_scope=options.tenant,
                                   complete=result.stopped is None, run_id=options.run_id,
                                   shard=options.id_range != (None, None))
        except StateError as e:
            result.state_error = str(e)


class MySqlDrainParts:
    def __init__(self, scheme: Scheme, options: DrainOptions) -> None:
        self.scheme = scheme
        self.options = options
        self.row_guard = MySqlRowGuard(scheme, options)
        self.guard: Guard = self.row_guard
        self.counter: Any = None

    def prepare(self, conn: MySqlConnection) -> None:
        self.row_guard.prepare(conn)

    def count_backlog(self, conn: MySqlConnection) -> int:
        return count_backlog(conn, self.scheme, self.options.tenant, self.options.id_range)

    def hold_failing_keys(self, conn: MySqlConnection, tally: Tally) -> None:
        """fpc1: decrypt every stale value of the WHOLE target once (every tenant, every shard's ids,
        as ``drain.fpc1_precheck`` does on PostgreSQL): hold back each key one of whose values fails,
        and record the failing rows of this drain's own id range. A shard or a ``--tenant`` run whose
        own values all pass must still rewrite nothing under a key that fails elsewhere: the wrong
        key's values that happen to pass the padding would be rewritten as garbage."""
        if isinstance(self.scheme, HoldsFailingKeys):
            hold_keys_failing_in(stale_rows(conn, self.scheme, self.options.id_range), self.scheme, tally,
                                 self.options.run_id)

    def range_bounds(self, conn: MySqlConnection, workers: int, backlog: int) -> list[Any]:
        return range_bounds(conn, self.scheme, self.options.tenant, self.options.id_range, workers)


class MySqlDrainPort:
    errors: tuple[type[BaseException], ...] = (pymysql.err.MySQLError,)
    lock_retry_errors: tuple[type[BaseException], ...] = ()  # the write never waits on a row
    serialization_errors: tuple[type[BaseException], ...] = ()

    def __init__(self) -> None:
        # The limits each open batch set (``start_batch``), reset when it ends; drains and their
        # reader and writer threads share the port.
        self._limits: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @staticmethod
    def describe_error(exc: BaseException | None) -> str:
        return mysql_connect.describe_db_error(exc)

    @staticmethod
    def parts(engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> MySqlDrainParts:
        return MySqlDrainParts(scheme, options)

    @staticmethod
    @contextlib.contextmanager
    def connect(engine: sa.Engine) -> Iterator[MySqlConnection]:
        with mysql_connect.raw_connection(engine) as conn, drain_session(conn):  # known to the row-lock watch
            yield conn

    @staticmethod
    def reading(conn: MySqlConnection, dry_run: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # each read is one statement; a dry run writes nothing

    @staticmethod
    def begin_read(conn: MySqlConnection, options: DrainOptions) -> None:
        return None  # autocommit: the read is one statement without row locks

    @staticmethod
    def end_read(conn: MySqlConnection, ok: bool) -> None:
        return None

    def begin_write(self, conn: MySqlConnection, target: ResolvedTarget, options: DrainOptions,
                    wait: float | None) -> None:
        limits = start_batch(conn, options.lock_timeout, options.statement_timeout, options.idle_timeout)
        with self._lock:
            self._limits[conn] = limits

    def commit(self, conn: MySqlConnection) -> None:
        try:
            commit_batch(conn)
        except CommitOutcomeUnknown as e:
            raise CommitLost(mysql_connect.describe_db_error(e.cause)) from None
        finally:
            self._end(conn)

    def rollback(self, conn: MySqlConnection) -> None:
        try:
            if conn.open:  # a session the server ended (idle_transaction_timeout) rolled back with it
                with contextlib.suppress(pymysql.err.MySQLError):
                    conn.rollback()
        finally:
            self._end(conn)

    def _end(self, conn: MySqlConnection) -> None:
        with self._lock:
            limits = self._limits.pop(conn, ())
        with contextlib.suppress(pymysql.err.MySQLError):
            end_batch(conn, limits)

    @staticmethod
    def make_durable(conn: MySqlConnection) -> None:
        return None  # see the module docstring


MYSQL_PORT = MySqlDrainPort()
