"""The drain of one target: count its backlog, run its workers' passes side by side, sweep what
others held locked, then the durability barrier, the recount and the CONFLICT record, before it
reports. The statements are its write guard's, the batch loop its pipeline's."""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa

from ..errors import DatabaseError
from ..log import log_event
from ..schemes.base import Scheme
from .guards import Guard
from .heap import long_lived_heap_frozen
from .options import DrainOptions
from .pg_port import PG_PORT
from .pipeline import BatchPipeline
from .port import DrainPort
from .results import STOP_DB_ERROR, DrainResult, Tally, first_reason

MAX_SWEEPS = 5


class Drain:
    """The drain of one target through its scheme (see the package docstring), on the database
    engine of ``port`` (PostgreSQL unless told)."""

    def __init__(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions, port: DrainPort = PG_PORT) -> None:
        self.engine = engine
        self.scheme = scheme
        self.target = scheme.target
        self.options = options
        self.port = port
        self._errors: tuple[type[BaseException], ...] = (*port.errors, DatabaseError)
        self.tally = Tally()
        self.parts = port.parts(engine, scheme, options)
        self.guard: Guard = self.parts.guard
        self.pipeline = BatchPipeline(engine, scheme, self.guard, options, self.tally, port)

    def count_backlog(self, conn: Any) -> int:
        """Rows (or values, for value-counting schemes) still to move, in scope."""
        return self.parts.count_backlog(conn)

    def run(self) -> DrainResult:
        opts = self.options
        name = self.target.name
        started = time.perf_counter()
        result = DrainResult(name, self.scheme.current_key, dry_run=opts.dry_run)
        try:
            with self.port.connect(self.engine) as conn, self.port.reading(conn, opts.dry_run):
                result.backlog_before = opts.planned_backlog or self.count_backlog(conn)
                if result.backlog_before:
                    self.parts.prepare(conn)
                    self.parts.hold_failing_keys(conn, self.tally)  # fpc1 (no integrity): check first
                bounds = (self.parts.range_bounds(conn, opts.workers, result.backlog_before)
                          if opts.workers > 1 and result.backlog_before else [])
        except self._errors as e:
            result.stopped, result.retryable = STOP_DB_ERROR, True
            result.error = (str(e) if isinstance(e, DatabaseError)
                            else f"target {name}: {self.port.describe_error(e)}")
            return result
        # A shard's lines name it: its backlog is the shard's, not the target's.
        log_event("target_started", run_id=opts.run_id or None, target=name, shard=opts.shard or None,
                  current_key=self.scheme.current_key, backlog=result.backlog_before, workers=len(bounds) + 1, dry_run=opts.dry_run or None)

        reason: str | None = None
        remaining: int | None = None  # the backlog as counted after the last batch, if it was
        if result.backlog_before:
            lo, hi = opts.id_range
            ranges = list(zip([lo, *bounds], [*bounds, hi]))
            if len(ranges) == 1:
                reason = self.pipeline.guarded_pass(0, lo, hi)
            else:
                with ThreadPoolExecutor(max_workers=len(ranges), thread_name_prefix=f"drain-{name}") as ex:
                    # Each worker runs in a copy of the caller's context, so that an orchestrator's
                    # run context (and with it the run's log handler) reaches the worker threads.
                    futures = [ex.submit(contextvars.copy_context().run, self.pipeline.guarded_pass, i, a, b)
                               for i, (a, b) in enumerate(ranges)]
                    reason = first_reason([f.result() for f in futures])
            if reason is None and not opts.dry_run:
                reason, remaining = self._sweep(lo, hi)
        self.tally.fill(result, reason)
        if opts.dry_run:
            result.backlog_remaining = result.backlog_before - result.reencrypted
        else:
            self._finish(result, remaining)
        result.duration_ms = (time.perf_counter() - started) * 1000
        log_event("target_completed", run_id=opts.run_id or None, target=name, shard=opts.shard or None,
                  reencrypted=result.reencrypted,
                  failed=len(result.failed), conflicts=result.conflicts or None, unknown=result.unknown or None,
                  unknown_key=result.unknown_key or None, legacy_left=result.legacy_left or None,
                  batches=result.batches, backlog_remaining=result.backlog_remaining, stopped=result.stopped,
                  duration_ms=round(result.duration_ms, 1), dry_run=opts.dry_run or None)
        return result

    def _sweep(self, lo: Any, hi: Any) -> tuple[str | None, int | None]:
        """Sweep from the start what the guard says was passed over (rows a live transaction held
        when SKIP LOCKED met them), while sweeps move something. (Why it stopped early or None, the
        backlog as counted after the last batch or None when it was not.)"""
        reason: str | None = None
        remaining: int | None = None
        sweeps = 0
        while reason is None and sweeps < MAX_SWEEPS:
            try:
                sweep = self.guard.next_sweep(self.engine, self.parts.counter, self.tally)
            except self._errors as e:
                # The count after the pass lost its connection (an outage, a killed backend): a
                # stop like a failed batch's, fail-closed and retryable; the batches stay committed.
                err = e if isinstance(e, DatabaseError) else DatabaseError(
                    f"target {self.target.name}: the count after the pass failed ({self.port.describe_error(e)})")
                return self.pipeline.fail(err, STOP_DB_ERROR, worker=0), None
            remaining = sweep.backlog  # the backlog now, unless a sweep moves something
            if not sweep.due:
                break
            before = self.tally.reencrypted
            sweeps += 1
            reason = self.pipeline.guarded_pass(0, lo, hi, sweep.only)
            if self.tally.reencrypted == before:
                break  # still locked by someone else: the next run takes them
            remaining = None
        return reason, remaining

    def _finish(self, result: DrainResult, remaining: int | None = None) -> None:
        """Make the batches durable, recount the backlog (unless ``remaining`` was counted after the
        last batch), record CONFLICT counts for the gate."""
        reached = False
        try:
            with self.port.connect(self.engine) as conn:
                if result.reencrypted:
                    self.port.make_durable(conn)  # a crash cannot undo what this drain reports
                result.backlog_remaining = self.count_backlog(conn) if remaining is None else remaining
                reached = True
                self.guard.record_conflicts(conn, result, self.options)
        except self._errors as e:
            # Without the barrier the last batches may not be on disk yet: the run must not
            # report success (a gate opened on it could be undone by a crash).
            if not reached:
                result.backlog_remaining = result.backlog_before - result.reencrypted
            if result.stopped is None:
                result.stopped, result.retryable = STOP_DB_ERROR, True
                result.error = (str(e) if isinstance(e, DatabaseError) else
                                f"target {self.target.name}: could not confirm the batches are durable "
                                f"({self.port.describe_error(e)})")
        if not reached:
            self.guard.record_conflicts(None, result, self.options)
        if result.state_error is not None:
            # Fail closed: a gate that cannot see this run's conflicts must not open on its word.
            result.error = result.error or f"target {self.target.name}: {result.state_error}"
            log_event("state_not_saved", level=40, run_id=self.options.run_id or None, target=self.target.name,
                      error=result.state_error)


def drain_target(engine: sa.Engine, scheme: Scheme, options: DrainOptions, port: DrainPort = PG_PORT) -> DrainResult:
    """Drain one target through its scheme (``schemes.build_scheme``) on ``port``'s engine."""
    with long_lived_heap_frozen():
        return Drain(engine, scheme, options, port).run()
