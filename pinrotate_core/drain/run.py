"""The drain of one target: count its backlog, run its workers' passes side by side over the
write guard's statements, sweep what others held locked, then the durability barrier, the recount
and the CONFLICT record, before it reports."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ..db import describe_db_error, raw_connection
from ..durability import force_flush
from ..errors import DatabaseError, KeyUnavailable, ThrottleCritical
from ..log import log_event
from ..schemes.base import BatchPlan, Scheme, Write
from ..state import NO_TENANT, StateError, record_conflicts
from ..targets import begin_writing_batch
from .counting import BacklogCounter
from .heap import long_lived_heap_frozen
from .options import DrainOptions, stop_reason
from .results import (
    STOP_CANCELLED,
    STOP_DB_ERROR,
    STOP_KEY_UNAVAILABLE,
    STOP_THROTTLE_CRITICAL,
    BatchEvent,
    BatchOutcome,
    DrainResult,
    Tally,
    first_reason,
)
from .selection import Selection
from .shards import ShardPlanner

if TYPE_CHECKING:
    from ..throttle import Throttle

MAX_SWEEPS = 5
HALT_POLL = 0.05  # seconds: how soon a reader waiting between batches sees its pass end


@dataclass(frozen=True)
class _Fetched:
    """A batch the reader thread read (and, with the lock guard, locked)."""

    rows: list[tuple[Any, ...]]
    size: int  # rows asked for: fewer came back only at the end of the range
    locked: float  # perf_counter() at its BEGIN: the start of its lock hold


class _AnyEvent:
    """Set when any of its events is set: the reader's wait ends on a stop, the end of its pass,
    or a sibling worker's fail-closed stop. The first event wakes a wait at once, the others
    within ``HALT_POLL`` seconds."""

    def __init__(self, *events: threading.Event) -> None:
        self._events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._events[0].wait(HALT_POLL if remaining is None else min(HALT_POLL, remaining))
        return True


@dataclass(frozen=True)
class _Pending:
    """A batch handed to the writer thread."""

    future: Future[BatchOutcome]
    worker: int
    batch_no: int
    rows: int
    plan: BatchPlan
    started: float


class Drain:
    """The drain of one target through its scheme (see the package docstring)."""

    def __init__(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> None:
        self.engine = engine
        self.scheme = scheme
        self.target = scheme.target
        self.options = options
        self.tally = Tally()
        self._stop_target = threading.Event()  # one worker's fail-closed stop stops its siblings
        self._locks = scheme.guard == "lock" and not options.dry_run
        self._sel = selection = Selection(scheme, options.tenant)
        self.counter = BacklogCounter(scheme, selection, options.id_range)
        self.planner = ShardPlanner(selection, options.id_range, options.run_id)
        self._statements: dict[tuple[int, ...], sql.Composed] = {}

    # -- SQL ---------------------------------------------------------------------------------

    def _select(self, lo: Any, hi: Any, size: int) -> tuple[sql.Composed, list[Any]]:
        return self._sel.next_batch(lo, hi, size, lock=self._locks)

    def _update(self, write: Write) -> sql.Composed:
        """One set-based statement for a write; arrays are cast to base types (``varchar``, never
        ``varchar(n)``), so a value too long for its column is an error that rolls the batch back,
        never a silent truncation."""
        cached = self._statements.get(write.columns)
        if cached is not None:
            return cached
        columns = [self.target.columns[j] for j in write.columns]
        id_type = sql.SQL("{}[]").format(sql.Identifier(self.target.id_column.type_name))
        arrays: list[sql.Composable]
        if self.scheme.guard == "lock":
            arrays = [sql.SQL("%b::{}").format(id_type)]
            arrays += [sql.SQL("%b::{}[]").format(sql.Identifier(c.type_name)) for c in columns]
            names = [sql.Identifier(f"n{i}") for i in range(len(columns))]
            sets = [sql.SQL("{} = u.{}").format(sql.Identifier(c.name), n) for c, n in zip(columns, names)]
            kv = self.scheme.key_version_column()
            if kv is not None:
                sets.append(sql.SQL("{} = {}").format(sql.Identifier(kv.name), sql.Literal(int(self.scheme.current_key))))
            # Guard: the locked row is still stale and in scope (it cannot have changed, but never write blind).
            statement = sql.SQL(
                "UPDATE {rel} AS t SET {sets} FROM unnest({arrays}) AS u(pinrotate_id, {names}) "
                "WHERE t.{id} = u.pinrotate_id AND {guard}"
            ).format(rel=self.target.relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
                     names=sql.SQL(", ").join(names), id=self._sel.id, guard=self._sel.where_t)
        else:
            arrays = [sql.SQL("%s::{}").format(id_type)]
            arrays += [sql.SQL("%s::text[]")] * (2 * len(columns))
            names = []
            sets = []
            same = []
            for i, c in enumerate(columns):
                old, new = sql.Identifier(f"o{i}"), sql.Identifier(f"n{i}")
                names += [old, new]
                ref = sql.Identifier("t", c.name)
                if c.type_name == "jsonb":
                    sets.append(sql.SQL("{} = u.{}::jsonb").format(sql.Identifier(c.name), new))
                    same.append(sql.SQL("{} = u.{}::jsonb").format(ref, old))
                elif c.type_name == "json":
                    sets.append(sql.SQL("{} = u.{}::json").format(sql.Identifier(c.name), new))
                    same.append(sql.SQL("{}::text = u.{}").format(ref, old))
                else:
                    sets.append(sql.SQL("{} = u.{}").format(sql.Identifier(c.name), new))
                    same.append(sql.SQL("{} = u.{}").format(ref, old))
            # Lock first, never wait: a row an application holds locked is skipped (left for the
            # sweep or the next run, as the lock guard's SKIP LOCKED leaves it), the others are
            # locked and written where they still hold the values read. (true, id) per row
            # written, (false, id) per row locked.
            statement = sql.SQL(
                "WITH pinrotate_locked AS MATERIALIZED ("
                "SELECT u.* FROM unnest({arrays}) AS u(pinrotate_id, {names}) JOIN {rel} AS t "
                "ON t.{id} = u.pinrotate_id FOR NO KEY UPDATE OF t SKIP LOCKED), "
                "pinrotate_moved AS (UPDATE {rel} AS t SET {sets} FROM pinrotate_locked AS u "
                "WHERE t.{id} = u.pinrotate_id AND {same} AND {scope} RETURNING t.{id} AS pinrotate_id) "
                "SELECT true, pinrotate_id FROM pinrotate_moved UNION ALL SELECT false, pinrotate_id FROM pinrotate_locked"
            ).format(rel=self.target.relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
                     names=sql.SQL(", ").join(names), id=self._sel.id, same=sql.SQL(" AND ").join(same),
                     scope=self._sel.scope_t)
        self._statements[write.columns] = statement
        return statement

    def count_backlog(self, conn: psycopg.Connection[Any]) -> int:
        """Rows (or values, for value-counting schemes) still to move, in scope."""
        return self.counter.count_backlog(conn)

    # -- one batch ---------------------------------------------------------------------------

    def _should_stop(self) -> str | None:
        return stop_reason(self.options, self._stop_target)

    def _next_batch(self, conn: psycopg.Connection[Any], lo: Any, hi: Any, first: bool,
                    halt: _AnyEvent) -> _Fetched | None:
        """Reader thread: wait until the next batch may start (throttle, or ``inter_batch_delay``)
        while holding nothing, then BEGIN and read it. None: the pass stopped before it began."""
        opts = self.options
        size = opts.batch_size
        if opts.throttle is not None:
            opts.throttle.before_batch(halt, opts.deadline, first=first)
            size = opts.throttle.batch_size
        elif opts.inter_batch_delay and not first:
            halt.wait(opts.inter_batch_delay)
        if halt.is_set() or self._should_stop():
            return None
        locked = time.perf_counter()
        return _Fetched(self._fetch(conn, lo, hi, size), size, locked)

    def _fetch(self, conn: psycopg.Connection[Any], lo: Any, hi: Any, size: int) -> list[tuple[Any, ...]]:
        """BEGIN and read (with the lock guard: lock) the next batch after ``lo`` (reader thread)."""
        query, params = self._select(lo, hi, size)
        conn.execute("BEGIN")
        try:
            if not self.options.dry_run:
                begin_writing_batch(conn, self.target)  # triggers = "disable": SET LOCAL session_replication_role
                # Per batch: never wait long for a lock an application holds, never run away, and
                # never hold rows for ever: the server ends a batch transaction left idle longer
                # than idle_timeout (a stuck key provider, a frozen process), which rolls it back.
                for name, seconds in (("lock_timeout", self.options.lock_timeout),
                                      ("statement_timeout", self.options.statement_timeout),
                                      ("idle_in_transaction_session_timeout", self.options.idle_timeout)):
                    conn.execute(sql.SQL("SET LOCAL {} = {}").format(sql.Identifier(name),
                                                                     sql.Literal(f"{int(seconds * 1000)}ms")))
            return conn.cursor(binary=True).execute(query, params).fetchall()
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
            raise

    def _write(self, conn: psycopg.Connection[Any], plan: BatchPlan) -> BatchOutcome:
        """The batch's writes and COMMIT (writer thread); ROLLBACK on any error: whole or nothing."""
        outcome = BatchOutcome()
        try:
            for write in plan.writes:
                if not write.ids:
                    continue
                if self.scheme.guard == "lock":
                    cur = conn.cursor(binary=True)
                    cur.execute(self._update(write), [write.ids, *write.new])
                    if cur.rowcount != len(write.ids):
                        # Cannot happen while we hold the row locks; if it does, write nothing.
                        raise DatabaseError(f"target {self.target.name}: batch updated {cur.rowcount} rows, "
                                            f"expected {len(write.ids)}")
                    outcome.reencrypted += sum(write.weights)
                else:
                    self._compare_and_swap(conn, write, outcome)
            conn.execute("COMMIT")
            outcome.committed = time.perf_counter()
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
            raise
        return outcome

    def _compare_and_swap(self, conn: psycopg.Connection[Any], write: Write, outcome: BatchOutcome) -> None:
        params: list[Any] = [write.ids]
        for old, new in zip(write.old, write.new):
            params += [old, new]
        matched: set[Any] = set()
        locked: set[Any] = set()
        for moved, row_id in conn.execute(self._update(write), params).fetchall():
            (matched if moved else locked).add(row_id)
        # Not locked: someone else holds the row (or it is gone); locked but not written: a miss.
        missed = [i for i, row_id in enumerate(write.ids) if row_id not in matched]
        settled: set[Any] = set()
        held: set[Any] = set()
        if missed:
            # A miss whose value is already on the current key was moved by another run: not a
            # conflict. A row we could not lock that is still there (in scope) is held by someone
            # else: left as it is, for the sweep. A row that is gone is a conflict, as before.
            columns = [self.target.columns[j] for j in write.columns]
            query = sql.SQL("SELECT {id}, {cols} FROM {rel} WHERE {id} = ANY(%s) AND {scope}").format(
                id=self._sel.id, cols=sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c.name))
                                                     for c in columns),
                rel=self.target.relation, scope=self._sel.scope)
            read = {write.ids[i]: [old[i] for old in write.old] for i in missed}
            for row in conn.execute(query, [list(read)]).fetchall():
                if row[0] not in locked:
                    held.add(row[0])
                elif all(self.scheme.settled(c, r, v) for c, r, v in zip(columns, read[row[0]], row[1:])):
                    settled.add(row[0])
        column = ",".join(self.target.columns[j].name for j in write.columns)
        for i, row_id in enumerate(write.ids):
            if row_id in matched:
                outcome.reencrypted += write.weights[i]
            elif row_id in settled:
                outcome.settled += write.weights[i]
            elif row_id in held:
                outcome.held.append(row_id)
            else:
                outcome.conflicts += write.weights[i]
                outcome.lost.append((row_id, column, write.tenants[i] or NO_TENANT, write.weights[i]))

    def _record(self, worker: int, batch_no: int, rows: int, plan: BatchPlan, outcome: BatchOutcome,
                started: float) -> None:
        """Count a committed (or, in a dry run, computed) batch and tell the world."""
        opts = self.options
        name = self.target.name
        self.tally.add(plan, outcome)
        event = BatchEvent(name, worker, batch_no, rows, outcome.reencrypted, len(plan.failed),
                           ((outcome.committed or time.perf_counter()) - started) * 1000, opts.dry_run,
                           conflicts=outcome.conflicts)
        log_event("batch_processed", run_id=opts.run_id or None, target=name, worker=worker, batch=batch_no,
                  rows=rows, reencrypted=event.reencrypted, failed=event.failed, conflicts=event.conflicts or None,
                  held_by_others=len(outcome.held) or None,
                  unknown=plan.counts.get("unknown") or None, legacy_left=plan.counts.get("legacy_left") or None,
                  duration_ms=round(event.duration_ms, 1), dry_run=opts.dry_run or None)
        for f in plan.failed:
            log_event("row_failed", level=30, run_id=opts.run_id or None, target=name, id=f.id,
                      columns=list(f.columns), reason=f.reason)
        for row_id, column, _, n in outcome.lost:
            log_event("value_conflict", level=30, run_id=opts.run_id or None, target=name, id=str(row_id),
                      column=column, values=n)
        if opts.on_batch is not None:
            opts.on_batch(event)

    def _settle(self, pending: _Pending) -> None:
        outcome = pending.future.result()  # re-raises the writer's error after its ROLLBACK
        self._record(pending.worker, pending.batch_no, pending.rows, pending.plan, outcome, pending.started)

    # -- a pass --------------------------------------------------------------------------------

    def _pass(self, worker: int, lo: Any, hi: Any, only: frozenset[Any] | None = None) -> str | None:
        """One keyset pass over ``(lo, hi]``; returns why it stopped early, or None when done. With
        ``only`` (a compare-and-swap sweep), only those rows are planned and written.

        Pipelined over three connections: while this thread re-encrypts batch N, a reader thread
        reads (and locks) batch N+1 and a writer thread sends batch N-1's writes and COMMIT, so the
        database and the crypto work overlap. Each batch is still exactly one transaction on one
        connection, and is counted only once its COMMIT is confirmed. Every wait between batches
        (the throttle, ``inter_batch_delay``) happens in the reader before it BEGINs the next
        batch, so no wait ever holds a row lock: a row is locked from its batch's SELECT to its
        COMMIT, which spans the re-encryption of the batch before it and of its own (see
        ``reference.md``, "How long a row stays locked").
        """
        opts = self.options
        t = self.target
        dry = opts.dry_run
        throttle = opts.throttle
        reason: str | None = None
        halt_pass = threading.Event()  # set when this pass ends: a reader waiting for the throttle gives up
        halt = _AnyEvent(opts.stop, halt_pass, self._stop_target)
        with contextlib.ExitStack() as stack:
            conns = [stack.enter_context(raw_connection(self.engine)) for _ in range(2 if dry else 3)]
            for c in conns:
                prepare_session(c, dry)
            reader = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"read-{t.name}"))
            writer = None if dry else stack.enter_context(
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"write-{t.name}"))
            k = 0
            pending: _Pending | None = None
            open_tx: psycopg.Connection[Any] | None = None
            # In a copy of this thread's context, as the workers are: the throttle's log lines
            # reach an orchestrator's run log.
            next_fetch: Future[_Fetched | None] | None = reader.submit(
                contextvars.copy_context().run, self._next_batch, conns[0], lo, hi, True, halt)
            try:
                while next_fetch is not None:
                    conn = conns[k % len(conns)]
                    fetching, next_fetch = next_fetch, None
                    fetched = fetching.result()  # a failed fetch has rolled its own transaction back
                    if fetched is None:  # stopped before it began: nothing was read
                        reason = self._should_stop() or STOP_CANCELLED
                        break
                    rows, started = fetched.rows, fetched.locked
                    open_tx = conn
                    if not rows:
                        break
                    reason = self._should_stop()
                    if reason:
                        break  # this batch was only read: it rolls back below
                    if len(rows) == fetched.size:  # more to come: lock the next batch while this one is worked
                        next_fetch = reader.submit(contextvars.copy_context().run, self._next_batch,
                                                   conns[(k + 1) % len(conns)], rows[-1][0], hi, False, halt)
                    if only is not None:
                        rows = [r for r in rows if r[0] in only]
                    plan = self.scheme.plan(rows, self.tally.failed_ids())
                    if opts.before_write is not None:
                        opts.before_write(k + 1, [r[0] for r in rows])
                    if pending is not None:
                        self._settle(pending)
                        pending = None
                    if writer is None:
                        conn.execute("ROLLBACK")
                        open_tx = None
                        self._record(worker, k + 1, len(rows), plan, BatchOutcome(reencrypted=plan.planned), started)
                    else:
                        pending = _Pending(writer.submit(self._write, conn, plan), worker, k + 1, len(rows), plan,
                                           started)
                        open_tx = None  # the writer owns this transaction now
                        if throttle is not None:  # lock-to-commit time feeds the batch sizer
                            pending.future.add_done_callback(_feeds_sizer(throttle, started, len(rows)))
                    k += 1
                if open_tx is not None:
                    open_tx.execute("ROLLBACK")
                    open_tx = None
                if pending is not None:
                    self._settle(pending)
                    pending = None
            except BaseException:
                # Fail closed: a batch being planned rolls back; a write in flight either commits
                # whole or rolls itself back. Nothing is half-written.
                halt_pass.set()
                if open_tx is not None:
                    with contextlib.suppress(psycopg.Error):
                        open_tx.execute("ROLLBACK")
                if next_fetch is not None:  # a read-ahead of the next batch was in flight: release it
                    with contextlib.suppress(BaseException):
                        if next_fetch.result() is not None:  # submitted in batch k's turn, before k += 1
                            conns[(k + 1) % len(conns)].execute("ROLLBACK")
                if pending is not None:
                    with contextlib.suppress(BaseException):
                        self._settle(pending)
                raise
            finally:
                halt_pass.set()
        return reason

    def _guarded_pass(self, worker: int, lo: Any, hi: Any, only: frozenset[Any] | None = None) -> str | None:
        try:
            return self._pass(worker, lo, hi, only)
        except KeyUnavailable as e:
            self._fail(e, STOP_KEY_UNAVAILABLE, worker)
            return STOP_KEY_UNAVAILABLE
        except DatabaseError as e:
            self._fail(e, STOP_DB_ERROR, worker)
            return STOP_DB_ERROR
        except ThrottleCritical as e:  # fail-safe stop between batches (exit 4)
            self._fail(e, STOP_THROTTLE_CRITICAL, worker)
            return STOP_THROTTLE_CRITICAL
        except psycopg.Error as e:
            err = DatabaseError(f"target {self.target.name}: batch rolled back ({describe_db_error(e)})")
            self._fail(err, STOP_DB_ERROR, worker)
            return STOP_DB_ERROR

    def _fail(self, exc: BaseException, reason: str, worker: int) -> None:
        with self.tally.lock:
            if self.tally.error is None:
                self.tally.error = exc
        self._stop_target.set()
        log_event("batch_failed", level=40, run_id=self.options.run_id or None, target=self.target.name,
                  worker=worker, reason=reason, error=str(exc))

    # -- the drain -------------------------------------------------------------------------------

    def run(self) -> DrainResult:
        opts = self.options
        name = self.target.name
        started = time.perf_counter()
        result = DrainResult(name, self.scheme.current_key, dry_run=opts.dry_run)
        try:
            with raw_connection(self.engine) as conn:
                if opts.dry_run:
                    conn.execute("SET default_transaction_read_only = on")
                result.backlog_before = opts.planned_backlog or self.count_backlog(conn)
                bounds = (self.planner.range_bounds(conn, opts.workers, result.backlog_before)
                          if opts.workers > 1 and result.backlog_before else [])
        except (psycopg.Error, DatabaseError) as e:
            result.stopped, result.retryable = STOP_DB_ERROR, True
            result.error = str(e) if isinstance(e, DatabaseError) else f"target {name}: {describe_db_error(e)}"
            return result
        log_event("target_started", run_id=opts.run_id or None, target=name, current_key=self.scheme.current_key,
                  backlog=result.backlog_before, workers=len(bounds) + 1, dry_run=opts.dry_run or None)

        reason: str | None = None
        remaining: int | None = None  # the backlog as counted after the last batch, if it was
        if result.backlog_before:
            lo, hi = opts.id_range
            ranges = list(zip([lo, *bounds], [*bounds, hi]))
            if len(ranges) == 1:
                reason = self._guarded_pass(0, lo, hi)
            else:
                with ThreadPoolExecutor(max_workers=len(ranges), thread_name_prefix=f"drain-{name}") as ex:
                    # Each worker runs in a copy of the caller's context, so that an orchestrator's
                    # run context (and with it the run's log handler) reaches the worker threads.
                    futures = [ex.submit(contextvars.copy_context().run, self._guarded_pass, i, a, b)
                               for i, (a, b) in enumerate(ranges)]
                    reason = first_reason([f.result() for f in futures])
            # Sweep from the start: SKIP LOCKED passed over rows that a live transaction held.
            sweeps = 0
            while reason is None and not self._locks and not opts.dry_run and sweeps < MAX_SWEEPS:
                # Compare-and-swap: only the rows an application held locked at the write are tried
                # again (a conflict is left as it is, for the next run to read afresh).
                held = self.tally.take_held()
                if not held:
                    break
                before = self.tally.reencrypted
                sweeps += 1
                reason = self._guarded_pass(0, lo, hi, held)
                if self.tally.reencrypted == before:
                    break  # still locked by someone else: the next run takes them
            while reason is None and self._locks and sweeps < MAX_SWEEPS:
                with raw_connection(self.engine) as conn:
                    left, unfailed = self.counter.count_left(conn, self.tally.failed_ids())
                remaining = left  # the backlog now, unless a sweep moves something
                if not unfailed:
                    break
                before = self.tally.reencrypted
                sweeps += 1
                reason = self._guarded_pass(0, lo, hi)
                if self.tally.reencrypted != before:
                    remaining = None
                else:
                    break  # still locked by someone else: the next run takes them
        self.tally.fill(result, reason)
        if opts.dry_run:
            result.backlog_remaining = result.backlog_before - result.reencrypted
        else:
            self._finish(result, remaining)
        result.duration_ms = (time.perf_counter() - started) * 1000
        log_event("target_completed", run_id=opts.run_id or None, target=name, reencrypted=result.reencrypted,
                  failed=len(result.failed), conflicts=result.conflicts or None, unknown=result.unknown or None,
                  unknown_key=result.unknown_key or None, legacy_left=result.legacy_left or None,
                  batches=result.batches, backlog_remaining=result.backlog_remaining, stopped=result.stopped,
                  duration_ms=round(result.duration_ms, 1), dry_run=opts.dry_run or None)
        return result

    def _finish(self, result: DrainResult, remaining: int | None = None) -> None:
        """Make the batches durable, recount the backlog (unless ``remaining`` was counted after the
        last batch), record CONFLICT counts for the gate."""
        reached = False
        try:
            with raw_connection(self.engine) as conn:
                if result.reencrypted:
                    # Batches commit with synchronous_commit = off: one synchronous commit flushes the
                    # WAL behind every one of them, so a crash cannot undo what this drain reports.
                    force_flush(conn)
                result.backlog_remaining = self.count_backlog(conn) if remaining is None else remaining
                reached = True
                if self.scheme.guard == "cas":
                    try:
                        # A shard (an id range) adds its conflicts and clears nothing: its siblings'
                        # are not its own (record_run_conflicts replaces them once all have ended).
                        record_conflicts(conn, self.target.name, result.conflicts_by_tenant,
                                         tenant_scope=self.options.tenant, complete=result.stopped is None,
                                         run_id=self.options.run_id, shard=self.options.id_range != (None, None))
                    except StateError as e:
                        result.state_error = str(e)
        except (psycopg.Error, DatabaseError) as e:
            # Without the barrier the last batches may not be on disk yet: the run must not
            # report success (a gate opened on it could be undone by a crash).
            if not reached:
                result.backlog_remaining = result.backlog_before - result.reencrypted
            if result.stopped is None:
                result.stopped, result.retryable = STOP_DB_ERROR, True
                result.error = (str(e) if isinstance(e, DatabaseError) else
                                f"target {self.target.name}: could not confirm the batches are durable "
                                f"({describe_db_error(e)})")
        if self.scheme.guard == "cas" and not reached:
            result.state_error = "the CONFLICT counts could not be recorded: the database was unreachable"
        if result.state_error is not None:
            # Fail closed: a gate that cannot see this run's conflicts must not open on its word.
            result.error = result.error or f"target {self.target.name}: {result.state_error}"
            log_event("state_not_saved", level=40, run_id=self.options.run_id or None, target=self.target.name,
                      error=result.state_error)


def prepare_session(conn: psycopg.Connection[Any], dry_run: bool) -> None:
    """Session settings of a drain connection (reset when it goes back to the pool)."""
    conn.execute("SET application_name = 'pinrotate'")
    # Keep each batch on the primary key: on small tables the planner may otherwise hash-join
    # the batch against a sequential scan of the whole table.
    conn.execute("SET enable_hashjoin = off")
    conn.execute("SET enable_mergejoin = off")
    if dry_run:
        conn.execute("SET default_transaction_read_only = on")
    else:
        # A commit lost in a crash only leaves its rows on the old key, which is still in the
        # keyring: the next run takes them again. So batches need not wait for each WAL flush;
        # the drain ends with durability.force_flush() before it reports.
        conn.execute("SET synchronous_commit = off")


def _feeds_sizer(throttle: Throttle, started: float, rows: int) -> Callable[[Future[BatchOutcome]], None]:
    """A done-callback telling the throttle how long a committed batch held its locks."""
    def done(future: Future[BatchOutcome]) -> None:
        if not future.cancelled() and future.exception() is None:
            throttle.batch_done(time.perf_counter() - started, rows)
    return done


def drain_target(engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> DrainResult:
    """Drain one target through its scheme (``schemes.build_scheme``)."""
    with long_lived_heap_frozen():
        return Drain(engine, scheme, options).run()
