"""The batch pipeline of one drain: keyset passes over id ranges, pipelined over three connections
(one batch being read, one re-encrypted, one written), every wait between batches taken before
the next batch is read. A batch is read without row locks and written in one short transaction
of its own, so no row is locked while a batch is re-encrypted or while the drain waits. It counts
a batch only once its COMMIT is confirmed and never half-writes one; which statements it runs is
its write guard's.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .. import tracing
from ..errors import DatabaseError, KeyUnavailable, ThrottleCritical
from ..log import log_event
from ..schemes.base import NOT_STORED, BatchPlan, FailedRow, Scheme
from .guards import Guard
from .options import DrainOptions, stop_reason
from .port import CommitLost, DrainPort
from .results import (
    STOP_CANCELLED,
    STOP_DB_ERROR,
    STOP_KEY_UNAVAILABLE,
    STOP_THROTTLE_CRITICAL,
    BatchEvent,
    BatchOutcome,
    CommitUnknown,
    NotStored,
    NotStoredRows,
    Tally,
)

if TYPE_CHECKING:
    from ..throttle import Throttle

HALT_POLL = 0.05  # seconds: how soon a reader waiting between batches sees its pass end


@dataclass(frozen=True)
class _Fetched:
    """A batch the reader thread read."""

    rows: list[tuple[Any, ...]]
    size: int  # rows asked for: fewer came back only at the end of the range
    read: float  # perf_counter() when its read began


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


class BatchPipeline:
    """Passes over id ranges of one target, for the workers of one drain (they share its tally)."""

    def __init__(self, engine: sa.Engine, scheme: Scheme, guard: Guard, options: DrainOptions, tally: Tally,
                 port: DrainPort) -> None:
        self.engine = engine
        self.port = port
        self.scheme = scheme
        self.target = scheme.target
        self.guard = guard
        self.options = options
        self.tally = tally
        self.stopped = threading.Event()  # one worker's fail-closed stop stops its siblings

    def guarded_pass(self, worker: int, lo: Any, hi: Any, only: frozenset[Any] | None = None) -> str | None:
        """One pass (see ``_pass``); an error that stops the target is a stop reason, recorded once."""
        try:
            return self._pass(worker, lo, hi, only)
        except KeyUnavailable as e:
            return self.fail(e, STOP_KEY_UNAVAILABLE, worker)
        except DatabaseError as e:
            return self.fail(e, STOP_DB_ERROR, worker)
        except ThrottleCritical as e:  # fail-safe stop between batches (exit 4)
            return self.fail(e, STOP_THROTTLE_CRITICAL, worker)
        except self.port.errors as e:
            err = DatabaseError(f"target {self.target.name}: batch rolled back ({self.port.describe_error(e)})")
            return self.fail(err, STOP_DB_ERROR, worker)

    def fail(self, exc: BaseException, reason: str, worker: int) -> str:
        with self.tally.lock:
            if self.tally.error is None:
                self.tally.error = exc
        self.stopped.set()
        log_event("batch_failed", level=40, run_id=self.options.run_id or None, target=self.target.name,
                  worker=worker, reason=reason, error=str(exc))
        return reason

    def _should_stop(self) -> str | None:
        return stop_reason(self.options, self.stopped)

    # -- one batch ---------------------------------------------------------------------------

    def _next_batch(self, conn: Any, lo: Any, hi: Any, first: bool,
                    halt: _AnyEvent) -> _Fetched | None:
        """Reader thread: wait until the next batch may start (throttle, or ``inter_batch_delay``)
        while holding nothing, then read it. None: the pass stopped before it began."""
        opts = self.options
        size = opts.batch_size
        if opts.throttle is not None:
            opts.throttle.before_batch(halt, opts.deadline, first=first)
            size = opts.throttle.batch_size
        elif opts.inter_batch_delay and not first:
            # Never past the run's deadline: the wait ends there (in HALT_POLL slices, on a stop too).
            left = opts.inter_batch_delay if opts.deadline is None else opts.deadline - time.monotonic()
            halt.wait(max(0.0, min(opts.inter_batch_delay, left)))
        if halt.is_set() or self._should_stop():
            return None
        read = time.perf_counter()
        self.port.begin_read(conn, opts)  # no row lock: its own short transaction, if any
        try:
            rows = self.guard.read(conn, lo, hi, size)
            self.port.end_read(conn, True)
        except BaseException:
            self.port.end_read(conn, False)
            raise
        return _Fetched(rows, size, read)

    def _write(self, conn: Any, plan: BatchPlan, versions: Any) -> BatchOutcome:
        """The batch's writes and COMMIT in one transaction (writer thread); ROLLBACK on any error:
        whole or nothing. A row whose stored value is not the one written (a trigger kept or
        changed it) rolls the batch back; it is written again without that row, FAILED."""
        while True:
            try:
                return self._write_tries(conn, plan, versions)
            except NotStored as e:  # rolled back: each try leaves out at least one more row
                self._leave_out(plan, e)
            except NotStoredRows as e:
                self._leave_out_rows(plan, e.ids)

    def _leave_out(self, plan: BatchPlan, e: NotStored) -> None:
        """Take the rows ``e`` names out of ``plan``'s write, FAILED (``NOT_STORED``)."""
        at = next(i for i, w in enumerate(plan.writes) if w is e.write)
        plan.writes[at] = e.write.drop(e.positions)
        columns = tuple(self.target.columns[j].name for j in e.write.columns)
        plan.failed += [FailedRow(self.target.name, str(e.write.ids[p]), columns, NOT_STORED) for p in e.positions]
        log_event("batch_write_retried", level=30, run_id=self.options.run_id or None, target=self.target.name,
                  reason="the database stored another value than the one written", rows=len(e.positions))

    def _leave_out_rows(self, plan: BatchPlan, ids: set[Any]) -> None:
        """Take the rows ``ids`` out of every write of ``plan``, FAILED (``NOT_STORED``), each once
        with every column the plan wrote of it."""
        columns: dict[Any, list[str]] = {}
        for at, write in enumerate(plan.writes):
            positions = [p for p, row_id in enumerate(write.ids) if row_id in ids]
            for p in positions:
                columns.setdefault(write.ids[p], []).extend(self.target.columns[j].name for j in write.columns)
            if positions:
                plan.writes[at] = write.drop(positions)
        plan.failed += [FailedRow(self.target.name, str(row_id), tuple(dict.fromkeys(names)), NOT_STORED)
                        for row_id, names in columns.items()]
        log_event("batch_write_retried", level=30, run_id=self.options.run_id or None, target=self.target.name,
                  reason="the database stored another value than the one written", rows=len(columns))

    def _write_tries(self, conn: Any, plan: BatchPlan, versions: Any) -> BatchOutcome:
        """Where the guard's first try may wait on a row (``row_wait``) and that wait runs out, or
        a deadlock ends it, the batch is written again cautiously, never waiting on a row. A
        serialization failure (an application's commit moved a row while the write waited for it:
        a partition-key change) is the application winning a race: the batch is written again,
        once more at most, and the new snapshot no longer sees the row the application moved."""
        wait = self.guard.row_wait
        if wait is not None:
            wait = min(wait, self.options.lock_timeout)
            try:
                return self._write_once(conn, plan, versions, wait)
            except self.port.lock_retry_errors as e:
                self._retried(e)
        try:
            return self._write_once(conn, plan, versions, None)
        except self.port.serialization_errors as e:
            self._retried(e)
            return self._write_once(conn, plan, versions, None)

    def _retried(self, e: BaseException) -> None:
        reason = ("an application's commit moved a row the write waited for"
                  if isinstance(e, self.port.serialization_errors) else "a lock was held by someone else")
        log_event("batch_write_retried", level=20, run_id=self.options.run_id or None, target=self.target.name,
                  reason=reason)

    # -- tracing (issue 34): one span per batch transaction, nothing else changed ------------
    def _traced_write(self, batch_no: int, size: int, conn: Any, plan: BatchPlan,
                      versions: Any) -> BatchOutcome:
        """``_write`` in a ``pinrotate.batch`` span (names and counts only; no-op without tracing)."""
        with tracing.batch_span(self.options.run_id, self.target.name, self.scheme.current_key, size,
                                batch=batch_no) as span:
            outcome = self._write(conn, plan, versions)
            tracing.batch_written(span, outcome.reencrypted, outcome.conflicts, (f.reason for f in plan.failed))
            return outcome

    def _write_once(self, conn: Any, plan: BatchPlan, versions: Any,
                    wait: float | None) -> BatchOutcome:
        """One try: BEGIN (with ``wait`` as this transaction's lock_timeout; None: the session's,
        and the guard's cautious write), the writes, COMMIT."""
        outcome = BatchOutcome()
        try:
            self.port.begin_write(conn, self.target, self.options, wait)
            self.guard.write_batch(conn, plan, outcome, versions, wait is None and self.guard.row_wait is not None)
            try:
                self.port.commit(conn)
            except CommitLost as e:
                with self.tally.lock:
                    self.tally.commit_unknown += plan.planned
                raise CommitUnknown(self.target.name, plan.planned, e.described) from None
            outcome.committed = time.perf_counter()
        except BaseException:
            self.port.rollback(conn)
            raise
        return outcome

    def _record(self, worker: int, batch_no: int, rows: int, plan: BatchPlan, outcome: BatchOutcome,
                started: float) -> None:
        """Count a committed (or, in a dry run, computed) batch and tell the world."""
        opts = self.options
        name = self.target.name
        self.tally.add(plan, outcome)
        event = BatchEvent(name, worker, batch_no, rows, outcome.reencrypted, len(plan.failed),
                           ((outcome.committed or time.perf_counter()) - started) * 1000, opts.dry_run,
                           conflicts=outcome.conflicts)
        log_event("batch_processed", run_id=opts.run_id or None, target=name, shard=opts.shard or None,
                  worker=worker, batch=batch_no,
                  rows=rows, reencrypted=event.reencrypted, failed=event.failed, conflicts=event.conflicts or None,
                  held_by_others=(len(outcome.held) + outcome.skipped_locked) or None,
                  changed_by_others=outcome.changed or None,
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
        reads batch N+1 and a writer thread sends batch N-1's writes and COMMIT, so the database
        and the crypto work overlap. Reads take no row lock; each batch's writes are exactly one
        transaction on one connection, and it is counted only once its COMMIT is confirmed. A row
        is locked only from its batch's write statement to its COMMIT (see ``reference.md``, "How
        long a row stays locked"); every wait between batches (the throttle, ``inter_batch_delay``)
        happens in the reader, before the next batch is read.
        """
        opts = self.options
        t = self.target
        dry = opts.dry_run
        throttle = opts.throttle
        reason: str | None = None
        halt_pass = threading.Event()  # set when this pass ends: a reader waiting for the throttle gives up
        halt = _AnyEvent(opts.stop, halt_pass, self.stopped)
        with contextlib.ExitStack() as stack:
            conns = [stack.enter_context(self.port.connect(self.engine)) for _ in range(2 if dry else 3)]
            reader = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"read-{t.name}"))
            writer = None if dry else stack.enter_context(
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"write-{t.name}"))
            k = 0
            pending: _Pending | None = None
            # In a copy of this thread's context, as the workers are: the throttle's log lines
            # reach an orchestrator's run log.
            next_fetch: Future[_Fetched | None] | None = reader.submit(
                contextvars.copy_context().run, self._next_batch, conns[0], lo, hi, True, halt)
            try:
                while next_fetch is not None:
                    conn = conns[k % len(conns)]
                    fetching, next_fetch = next_fetch, None
                    fetched = fetching.result()
                    if fetched is None:  # stopped before it began: nothing was read
                        reason = self._should_stop() or STOP_CANCELLED
                        break
                    rows, started = fetched.rows, fetched.read
                    if not rows:
                        break
                    reason = self._should_stop()
                    if reason:
                        break  # this batch was only read: nothing to undo
                    if len(rows) == fetched.size:  # more to come: read the next batch while this one is worked
                        next_fetch = reader.submit(contextvars.copy_context().run, self._next_batch,
                                                   conns[(k + 1) % len(conns)], self.guard.after(rows[-1]), hi, False, halt)
                    if only is not None:
                        rows = [r for r in rows if r[0] in only]
                    rows, versions = self.guard.received(rows)
                    plan = self.scheme.plan(rows, self.tally.failed_ids())
                    if opts.before_write is not None:
                        opts.before_write(k + 1, [r[0] for r in rows])
                    if pending is not None:
                        self._settle(pending)
                        pending = None
                    if writer is None:
                        self._record(worker, k + 1, len(rows), plan, BatchOutcome(reencrypted=plan.planned), started)
                    else:
                        # In a copy of this thread's context: the batch's span hangs from the drain's.
                        pending = _Pending(writer.submit(contextvars.copy_context().run, self._traced_write, k + 1,
                                                         fetched.size, conn, plan, versions), worker, k + 1,
                                           len(rows), plan, started)
                        if throttle is not None:  # read-to-commit time feeds the batch sizer
                            pending.future.add_done_callback(_feeds_sizer(throttle, len(rows), started))
                    k += 1
                if pending is not None:
                    self._settle(pending)
                    pending = None
            except BaseException:
                # Fail closed: a batch being planned was only read; a write in flight either
                # commits whole or rolls itself back. Nothing is half-written.
                halt_pass.set()
                if next_fetch is not None:  # a read-ahead of the next batch was in flight: let it end
                    with contextlib.suppress(BaseException):
                        next_fetch.result()
                if pending is not None:
                    with contextlib.suppress(BaseException):
                        self._settle(pending)
                raise
            finally:
                halt_pass.set()
        return reason


def _feeds_sizer(throttle: Throttle, rows: int, started: float) -> Callable[[Future[BatchOutcome]], None]:
    """A done-callback telling the throttle how long a committed batch took from its read to its
    COMMIT. Its rows are locked only for the write at the end of that, but batches are sized on the
    whole of it, as when they were locked from the read on: measured beside an application writer
    (benchmarks/writer_latency.py), sizing on the write alone made batches about four times larger
    and added about twice as much to the writer's p99."""
    def done(future: Future[BatchOutcome]) -> None:
        if not future.cancelled() and future.exception() is None:
            outcome = future.result()
            throttle.batch_done(outcome.committed - started, rows)
    return done
