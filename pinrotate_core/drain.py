"""The batch drain: move every row of a target from older keys to the current key.

Per target: keyset pagination by id (``id > last``), ``FOR UPDATE SKIP LOCKED``, one set-based
binary UPDATE per batch, one transaction per batch, workers owning disjoint id ranges, then sweeps
from the start for rows that were locked by someone else. A provider failure rolls the open batch
back and stops the target; a row that does not decrypt is left unchanged and reported. It never
touches a row on a newer key, and never writes anything but the cipher and key-version columns.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from .config import KeysSettings
from .db import describe_db_error, raw_connection
from .errors import DatabaseError, KeyUnavailable, ThrottleCritical
from .formats.aesgcm import AesGcmCipherSet
from .keyring import Keyring
from .log import log_event
from .reencrypt import BatchPlan, FailedRow, plan_aesgcm_batch
from .targets import ResolvedTarget

if TYPE_CHECKING:
    from .providers import KeyProvider
    from .throttle import Throttle

# Why a drain stopped before its backlog was empty.
STOP_KEY_UNAVAILABLE = "key_unavailable"
STOP_DB_ERROR = "db_error"
STOP_CANCELLED = "cancelled"
STOP_DEADLINE = "deadline"
STOP_THROTTLE_CRITICAL = "throttle_critical"  # issue 12 hook: a critical_* health limit was exceeded

MAX_SWEEPS = 5
SAMPLE_SIZE = 64


@dataclass(frozen=True)
class DrainOptions:
    batch_size: int = 200
    workers: int = 1
    inter_batch_delay: float = 0.0
    deadline: float | None = None  # time.monotonic() value; the rest is left for the next run
    dry_run: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    on_batch: Callable[[BatchEvent], None] | None = None
    run_id: str = ""
    tenant: str | None = None  # fpc1 targets with a tenant column: only this tenant's rows
    # Issue 12 hook (throttle.py, to be ported into the new drain): when set, it gives the batch
    # size, waits between batches instead of inter_batch_delay, and disables the lock-ahead.
    throttle: Throttle | None = None


@dataclass(frozen=True)
class BatchEvent:
    target: str
    worker: int
    batch: int
    rows: int
    reencrypted: int
    failed: int
    duration_ms: float
    dry_run: bool


@dataclass
class DrainResult:
    target: str
    current_key: str
    reencrypted: int = 0
    failed: list[FailedRow] = field(default_factory=list)
    conflicts: int = 0
    batches: int = 0
    duration_ms: float = 0.0
    backlog_before: int = 0
    backlog_remaining: int = 0
    stopped: str | None = None
    error: str | None = None
    retryable: bool = False
    dry_run: bool = False
    sample_ids: list[Any] = field(default_factory=list)

    @property
    def fail_closed(self) -> bool:
        """True when the run must report exit code 4 for this target."""
        return (self.stopped in (STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL) or bool(self.failed)
                or self.conflicts > 0)


@dataclass(frozen=True)
class _Pending:
    """A batch handed to the writer thread, counted only once its COMMIT is confirmed."""

    future: Future[None]
    worker: int
    batch_no: int
    rows: int
    plan: BatchPlan
    started: float


class _Tally:
    """Per-target counters shared by the workers of one drain."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reencrypted = 0
        self.batches = 0
        self.failed: dict[str, FailedRow] = {}
        self.error: BaseException | None = None
        self.sample: list[Any] = []  # reservoir of re-encrypted ids, re-read by the verify step
        self._seen = 0
        self._rng = random.Random()

    def add(self, plan: BatchPlan) -> None:
        with self.lock:
            self.reencrypted += plan.reencrypted
            self.batches += 1
            for f in plan.failed:
                self.failed.setdefault(f.id, f)
            if plan.ids:
                for row_id in (plan.ids[0], self._rng.choice(plan.ids)):
                    self._seen += 1
                    if len(self.sample) < SAMPLE_SIZE:
                        self.sample.append(row_id)
                    else:
                        slot = self._rng.randrange(self._seen)
                        if slot < SAMPLE_SIZE:
                            self.sample[slot] = row_id

    def failed_ids(self) -> frozenset[str]:
        with self.lock:
            return frozenset(self.failed)


class AesGcmDrain:
    """Drain of one ``aesgcm`` target: rows with ``key_version < current``.

    Subclasses for other formats override ``_selection``, ``_update`` and ``_plan_batch``; the
    keyset passes, pipelining, sweeps, stop rules and counting are shared.
    """

    def __init__(self, engine: sa.Engine, target: ResolvedTarget, keyring: Keyring, options: DrainOptions) -> None:
        self.engine = engine
        self.target = target
        self.keyring = keyring
        self.options = options
        self.current = keyring.current_version
        self.ciphers = AesGcmCipherSet(keyring)
        self.tally = _Tally()
        self._stop_target = threading.Event()  # one worker's fail-closed stop stops its siblings
        t = target.settings
        self._id = sql.Identifier(t.id)
        self._cols = [sql.Identifier(c) for c in t.columns]
        self._kv, self._backlog = self._selection()
        self._update_sql = self._update()

    def _selection(self) -> tuple[sql.Composable, sql.Composable]:
        """(the key-version expression, the backlog condition with one ``%s`` for current)."""
        t = self.target.settings
        assert t.key_version is not None
        kv = sql.Identifier(t.key_version)
        # The backlog: rows on an older key. "<" never selects a row on a newer key (key rolled back),
        # and never a NULL key version (drafts without a snapshot).
        conds = [sql.SQL("{} < %s").format(kv)]
        conds += [sql.SQL("{} IS NOT NULL").format(sql.Identifier(c)) for c in t.require_not_null]
        return kv, sql.SQL(" AND ").join(conds)

    def _plan_batch(self, rows: Sequence[Sequence[Any]]) -> BatchPlan:
        """The new values for a locked batch (pure; see ``reencrypt``)."""
        t = self.target
        return plan_aesgcm_batch(t.name, t.settings.columns, t.encodings, rows, self.ciphers,
                                 known_failed=self.tally.failed_ids())

    # -- SQL ---------------------------------------------------------------------------------

    def _select(self, lower: bool, upper: bool) -> sql.Composed:
        where = [self._backlog]
        if lower:
            where.append(sql.SQL("{} > %s").format(self._id))
        if upper:
            where.append(sql.SQL("{} <= %s").format(self._id))
        lock = sql.SQL("") if self.options.dry_run else sql.SQL(" FOR UPDATE SKIP LOCKED")
        return sql.SQL("SELECT {id}, {kv}, {cols} FROM {rel} WHERE {where} ORDER BY {id} LIMIT %s{lock}").format(
            id=self._id, kv=self._kv, cols=sql.SQL(", ").join(self._cols), rel=self.target.relation,
            where=sql.SQL(" AND ").join(where), lock=lock,
        )

    def _update(self) -> sql.Composed:
        # One set-based statement per batch; arrays travel binary (%b), ids cast to the key's type.
        names = [sql.Identifier(f"c{i}") for i in range(len(self._cols))]
        arrays = [sql.SQL("%b::{}[]").format(sql.SQL(self.target.id_column.sql_type))]
        arrays += [sql.SQL("%b::{}[]").format(sql.SQL(c.sql_type)) for c in self.target.columns]
        sets = [sql.SQL("{} = u.{}").format(col, name) for col, name in zip(self._cols, names)]
        sets.append(sql.SQL("{} = %s").format(self._kv))
        return sql.SQL(
            "UPDATE {rel} AS t SET {sets} FROM unnest({arrays}) AS u(pinrotate_id, {names}) "
            "WHERE t.{id} = u.pinrotate_id AND t.{kv} < %s"
        ).format(
            rel=self.target.relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
            names=sql.SQL(", ").join(names), id=self._id, kv=self._kv,
        )

    def count_backlog(self, conn: psycopg.Connection[Any], exclude: frozenset[str] = frozenset()) -> int:
        query = sql.SQL("SELECT count(*) FROM {rel} WHERE {backlog}").format(rel=self.target.relation, backlog=self._backlog)
        params: list[Any] = [self.current]
        if exclude:
            query = query + sql.SQL(" AND NOT ({}::text = ANY(%s))").format(self._id)
            params.append(list(exclude))
        row = conn.execute(query, params).fetchone()
        return int(row[0]) if row else 0

    def _range_bounds(self, conn: psycopg.Connection[Any], workers: int) -> list[Any]:
        """Split the backlog's ids into ``workers`` ranges of about equal size (one scan of ids)."""
        fractions = [i / workers for i in range(1, workers)]
        query = sql.SQL(
            "SELECT percentile_disc(%s::float8[]) WITHIN GROUP (ORDER BY {id}) FROM {rel} WHERE {backlog}"
        ).format(id=self._id, rel=self.target.relation, backlog=self._backlog)
        row = conn.execute(query, [fractions, self.current]).fetchone()
        bounds = [b for b in (row[0] if row and row[0] else []) if b is not None]
        return sorted(set(bounds))

    # -- the drain ---------------------------------------------------------------------------

    def _should_stop(self) -> str | None:
        return stop_reason(self.options, self._stop_target)

    def _prepare_session(self, conn: psycopg.Connection[Any]) -> None:
        prepare_session(conn, self.options.dry_run, relaxed_commit=True)

    def _write(self, conn: psycopg.Connection[Any], plan: BatchPlan) -> None:
        """UPDATE and COMMIT one planned batch (runs on the writer thread); ROLLBACK on any error."""
        try:
            if plan.ids:
                cur = conn.cursor(binary=True)
                # Placeholders in statement order: SET key_version, the unnest arrays, the WHERE guard.
                cur.execute(self._update_sql, [self.current, plan.ids, *plan.new_values, self.current])
                if cur.rowcount != len(plan.ids):
                    # Cannot happen while we hold the row locks; if it does, write nothing.
                    raise DatabaseError(
                        f"target {self.target.name}: batch updated {cur.rowcount} rows, expected {len(plan.ids)}"
                    )
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
            raise

    def _record(self, worker: int, batch_no: int, rows: int, plan: BatchPlan, started: float) -> None:
        """Count a committed (or, in a dry run, computed) batch and tell the world."""
        opts = self.options
        name = self.target.name
        self.tally.add(plan)
        event = BatchEvent(name, worker, batch_no, rows, plan.reencrypted, len(plan.failed),
                           (time.perf_counter() - started) * 1000, opts.dry_run)
        log_event("batch_processed", run_id=opts.run_id or None, target=name, worker=worker, batch=batch_no,
                  rows=rows, reencrypted=event.reencrypted, failed=event.failed,
                  duration_ms=round(event.duration_ms, 1), dry_run=opts.dry_run or None)
        for f in plan.failed:
            log_event("row_failed", level=30, run_id=opts.run_id or None, target=name, id=f.id,
                      columns=list(f.columns), reason=f.reason)
        if opts.on_batch is not None:
            opts.on_batch(event)

    def _fetch(self, conn: psycopg.Connection[Any], last: Any, hi: Any, size: int | None = None) -> list[tuple[Any, ...]]:
        """BEGIN and lock the next batch after ``last`` (runs on the reader thread)."""
        params: list[Any] = [self.current]
        if last is not None:
            params.append(last)
        if hi is not None:
            params.append(hi)
        params.append(self.options.batch_size if size is None else size)
        conn.execute("BEGIN")
        try:
            return conn.cursor(binary=True).execute(self._select(last is not None, hi is not None), params).fetchall()
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
            raise

    def _pass(self, worker: int, lo: Any, hi: Any) -> str | None:
        """One keyset pass over ``(lo, hi]``; returns why it stopped early, or None when done.

        Pipelined over three connections: while this thread re-encrypts batch N, a reader thread
        locks batch N+1 and a writer thread sends batch N-1's UPDATE and COMMIT, so the database
        and the crypto work overlap. Each batch is still exactly one transaction on one connection,
        and is counted only once its COMMIT is confirmed.
        """
        opts = self.options
        t = self.target
        dry = opts.dry_run
        throttle = opts.throttle  # issue 12 hook
        # A pause between batches (or a throttle that may wait) means: don't lock ahead.
        early_prefetch = not opts.inter_batch_delay and throttle is None
        size = opts.batch_size if throttle is None else throttle.batch_size  # of the batch being fetched
        reason: str | None = None
        with contextlib.ExitStack() as stack:
            conns = [stack.enter_context(raw_connection(self.engine)) for _ in range(2 if dry else 3)]
            for c in conns:
                self._prepare_session(c)
            reader = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"read-{t.name}"))
            writer = None if dry else stack.enter_context(
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"write-{t.name}"))
            k = 0
            next_fetch: Future[list[tuple[Any, ...]]] | None = None
            pending: _Pending | None = None
            open_tx: psycopg.Connection[Any] | None = None
            last = lo
            try:
                if throttle is not None:  # issue 12 hook: wait (or stop) before locking anything
                    throttle.before_batch(opts.stop, opts.deadline, first=True)
                    size = throttle.batch_size
                reason = self._should_stop()
                if reason is None:
                    next_fetch = reader.submit(self._fetch, conns[0], last, hi, size)
                while next_fetch is not None:
                    conn = conns[k % len(conns)]
                    started = time.perf_counter()
                    fetching, next_fetch = next_fetch, None
                    rows = fetching.result()  # a failed fetch has rolled its own transaction back
                    open_tx = conn
                    if not rows:
                        break
                    reason = self._should_stop()
                    if reason:
                        break  # this batch was only locked: it rolls back below
                    last = rows[-1][0]
                    more = len(rows) == size
                    if more and early_prefetch:
                        next_fetch = reader.submit(self._fetch, conns[(k + 1) % len(conns)], last, hi)
                    plan = self._plan_batch(rows)
                    if pending is not None:
                        self._settle(pending)
                        pending = None
                    if writer is None:
                        conn.execute("ROLLBACK")
                        open_tx = None
                        self._record(worker, k + 1, len(rows), plan, started)
                    else:
                        pending = _Pending(writer.submit(self._write, conn, plan), worker, k + 1, len(rows), plan,
                                           started)
                        open_tx = None  # the writer owns this transaction now
                        if throttle is not None:  # issue 12 hook: lock-to-commit time feeds the sizer
                            pending.future.add_done_callback(_feeds_sizer(throttle, started, len(rows)))
                    k += 1
                    if more and next_fetch is None:
                        if throttle is not None:  # issue 12 hook: the throttle paces instead of the delay
                            throttle.before_batch(opts.stop, opts.deadline)
                            size = throttle.batch_size
                            reason = self._should_stop()
                            if reason:
                                break
                        elif opts.inter_batch_delay and opts.stop.wait(opts.inter_batch_delay):
                            reason = STOP_CANCELLED
                            break
                        next_fetch = reader.submit(self._fetch, conns[k % len(conns)], last, hi, size)
                if open_tx is not None:
                    open_tx.execute("ROLLBACK")
                    open_tx = None
                if pending is not None:
                    self._settle(pending)
                    pending = None
            except BaseException:
                # Fail closed: a batch being planned rolls back; a write in flight either commits
                # whole or rolls itself back. Nothing is half-written.
                if open_tx is not None:
                    with contextlib.suppress(psycopg.Error):
                        open_tx.execute("ROLLBACK")
                if next_fetch is not None:  # a lock-ahead of the next batch was in flight: release it
                    with contextlib.suppress(BaseException):
                        next_fetch.result()
                        conns[(k + 1) % len(conns)].execute("ROLLBACK")
                if pending is not None:
                    with contextlib.suppress(BaseException):
                        self._settle(pending)
                raise
        return reason

    def _settle(self, pending: _Pending) -> None:
        pending.future.result()  # re-raises the writer's error after its ROLLBACK
        self._record(pending.worker, pending.batch_no, pending.rows, pending.plan, pending.started)

    def _guarded_pass(self, worker: int, lo: Any, hi: Any) -> str | None:
        try:
            return self._pass(worker, lo, hi)
        except KeyUnavailable as e:
            self._fail(e, STOP_KEY_UNAVAILABLE, worker)
            return STOP_KEY_UNAVAILABLE
        except DatabaseError as e:
            self._fail(e, STOP_DB_ERROR, worker)
            return STOP_DB_ERROR
        except ThrottleCritical as e:  # issue 12 hook: fail-safe stop between batches (exit 4)
            self._fail(e, STOP_THROTTLE_CRITICAL, worker)
            return STOP_THROTTLE_CRITICAL
        except psycopg.Error as e:
            err = DatabaseError(f"target {self.target.name}: batch rolled back ({describe_db_error(e)})")
            err.__cause__ = None
            self._fail(err, STOP_DB_ERROR, worker)
            return STOP_DB_ERROR

    def _fail(self, exc: BaseException, reason: str, worker: int) -> None:
        with self.tally.lock:
            if self.tally.error is None:
                self.tally.error = exc
        self._stop_target.set()
        log_event("batch_failed", level=40, run_id=self.options.run_id or None, target=self.target.name,
                  worker=worker, reason=reason, error=str(exc))

    def run(self) -> DrainResult:
        opts = self.options
        started = time.perf_counter()
        result = DrainResult(self.target.name, str(self.current), dry_run=opts.dry_run)
        try:
            with raw_connection(self.engine) as conn:
                result.backlog_before = self.count_backlog(conn)
                bounds = self._range_bounds(conn, opts.workers) if opts.workers > 1 and result.backlog_before else []
        except (psycopg.Error, DatabaseError) as e:
            result.stopped, result.retryable = STOP_DB_ERROR, True
            result.error = str(e) if isinstance(e, DatabaseError) else f"target {self.target.name}: {describe_db_error(e)}"
            return result
        log_event("target_started", run_id=opts.run_id or None, target=self.target.name, current_key=self.current,
                  backlog=result.backlog_before, workers=len(bounds) + 1, dry_run=opts.dry_run or None)

        stop_reason: str | None = None
        if result.backlog_before:
            ranges = list(zip([None, *bounds], [*bounds, None]))
            if len(ranges) == 1:
                stop_reason = self._guarded_pass(0, None, None)
            else:
                with ThreadPoolExecutor(max_workers=len(ranges), thread_name_prefix=f"drain-{self.target.name}") as ex:
                    # Each worker runs in a copy of the caller's context, so that an orchestrator's
                    # run context (and with it the run's log handler) reaches the worker threads.
                    futures = [ex.submit(contextvars.copy_context().run, self._guarded_pass, i, lo, hi)
                               for i, (lo, hi) in enumerate(ranges)]
                    reasons = [f.result() for f in futures]
                stop_reason = _first_reason(reasons)
            # Sweep from the start: SKIP LOCKED passed over rows that a live transaction held.
            sweeps = 0
            while stop_reason is None and not opts.dry_run and sweeps < MAX_SWEEPS:
                with raw_connection(self.engine) as conn:
                    left = self.count_backlog(conn, exclude=self.tally.failed_ids())
                if not left:
                    break
                before = self.tally.reencrypted
                sweeps += 1
                stop_reason = self._guarded_pass(0, None, None)
                if self.tally.reencrypted == before:
                    break  # still locked by someone else: the next run takes them
        result.reencrypted = self.tally.reencrypted
        result.batches = self.tally.batches
        result.failed = sorted(self.tally.failed.values(), key=lambda f: f.id)
        result.sample_ids = list(dict.fromkeys(self.tally.sample))
        result.stopped = stop_reason
        if self.tally.error is not None:
            result.error = str(self.tally.error)
            result.retryable = bool(getattr(self.tally.error, "retryable", isinstance(self.tally.error, DatabaseError)))
        if opts.dry_run:
            result.backlog_remaining = result.backlog_before - result.reencrypted
        else:
            try:
                with raw_connection(self.engine) as conn:
                    if result.reencrypted:
                        durability_barrier(conn)
                    result.backlog_remaining = self.count_backlog(conn)
            except (psycopg.Error, DatabaseError) as e:
                # Without the barrier the last batches may not be on disk yet: the run must not
                # report success (a gate opened on it could be undone by a crash).
                result.backlog_remaining = result.backlog_before - result.reencrypted
                if result.stopped is None:
                    result.stopped, result.retryable = STOP_DB_ERROR, True
                    result.error = (str(e) if isinstance(e, DatabaseError) else
                                    f"target {self.target.name}: could not confirm the batches are durable "
                                    f"({describe_db_error(e)})")
        result.duration_ms = (time.perf_counter() - started) * 1000
        log_event("target_completed", run_id=opts.run_id or None, target=self.target.name,
                  reencrypted=result.reencrypted, failed=len(result.failed), batches=result.batches,
                  backlog_remaining=result.backlog_remaining, stopped=result.stopped,
                  duration_ms=round(result.duration_ms, 1), dry_run=opts.dry_run or None)
        return result


def durability_barrier(conn: psycopg.Connection[Any]) -> None:
    """Return once every commit made so far is on disk.

    Batches commit with ``synchronous_commit = off``; one synchronous commit that writes a commit
    record flushes the WAL up to that record, and with it every batch committed before it, by
    any connection. A drain reports only after this, so a crash cannot undo what it reported.
    """
    with conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = on")
        conn.execute("SELECT pg_current_xact_id()")  # an xid: the COMMIT writes and flushes a record


def stop_reason(options: DrainOptions, target_stopped: threading.Event | None = None) -> str | None:
    """Why a drain must stop before its next batch, or None: checked between batches only."""
    if options.stop.is_set():
        return STOP_CANCELLED
    if target_stopped is not None and target_stopped.is_set():
        return STOP_KEY_UNAVAILABLE
    if options.deadline is not None and time.monotonic() >= options.deadline:
        return STOP_DEADLINE
    return None


def prepare_session(conn: psycopg.Connection[Any], dry_run: bool, *, relaxed_commit: bool) -> None:
    """Session settings of a drain connection (reset when it goes back to the pool)."""
    # Keep each batch on the primary key: on small tables the planner may otherwise hash-join
    # the batch against a sequential scan of the whole table.
    conn.execute("SET enable_hashjoin = off")
    conn.execute("SET enable_mergejoin = off")
    if dry_run:
        conn.execute("SET default_transaction_read_only = on")
    elif relaxed_commit:
        # A commit lost in a crash only leaves its rows on the old key, which is still in the
        # keyring: the next run takes them again. So batches need not wait for each WAL flush;
        # the drain ends with durability_barrier() before it reports.
        conn.execute("SET synchronous_commit = off")


def _feeds_sizer(throttle: Throttle, started: float, rows: int) -> Callable[[Future[None]], None]:
    """Issue 12 hook: a done-callback telling the throttle how long a committed batch held its locks."""
    def done(future: Future[None]) -> None:
        if not future.cancelled() and future.exception() is None:
            throttle.batch_done(time.perf_counter() - started, rows)
    return done


def _first_reason(reasons: Sequence[str | None]) -> str | None:
    order = [STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL, STOP_CANCELLED, STOP_DEADLINE]
    present = [r for r in reasons if r]
    return min(present, key=order.index) if present else None


def drain_target(engine: sa.Engine, target: ResolvedTarget, keyring: Keyring, options: DrainOptions,
                 keys: KeysSettings | None = None, provider: KeyProvider | None = None) -> DrainResult:
    """Drain one target with the strategy its format needs (``keys``: the legacy switches of fpc1)."""
    fmt = target.settings.format
    if fmt == "aesgcm":
        return AesGcmDrain(engine, target, keyring, options).run()
    if fmt == "fpc1":
        from .drain_fpc1 import Fpc1Drain  # imported here: drain_fpc1 builds on this module

        return Fpc1Drain(engine, target, keyring, options, keys=keys).run()
    if fmt == "vault-transit":
        from .drain_transit import TransitDrain  # imported here: drain_transit builds on this module

        return TransitDrain(engine, target, keyring, options, provider).run()
    raise NotImplementedError(f"target {target.name}: format {fmt} has no drain yet")
