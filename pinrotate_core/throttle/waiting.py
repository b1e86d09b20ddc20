"""The throttle a drain asks before each batch: wait while the database is unwell or an operator
paused the run, in slices bounded by the run's deadline that re-read the operator's control.

It never writes to the database, never holds a lock while it asks the control source, and knows
nothing of the orchestrator; ``Throttle.state()`` is what a progress display shows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
import sqlalchemy as sa

from ..db import describe_db_error, raw_connection
from ..engines.postgresql.signals import APPLICATION_NAME, read_signals
from ..errors import DatabaseError, ThrottleCritical
from ..log import log_event
from .control import ThrottleControl, ThrottleControlSource, parse_control
from .replicas import ReplicaLagMeter
from .sizer import BatchSizer

if TYPE_CHECKING:
    from ..config import Settings
    from ..metrics import RotationMetrics

REASON_PAUSED = "paused"
REASON_LAG = "lag"
REASON_LOAD = "load"
REASON_LOCKS = "locks"
REASONS = (REASON_LAG, REASON_LOAD, REASON_LOCKS, REASON_PAUSED)

POLL_INTERVAL = 0.5  # seconds before the second look at the database while waiting
# The longest any wait sleeps before it looks again, re-reading the operator's control: a changed
# Variable (or a deadline) takes effect within this, whatever delay or back-off was in force.
MAX_WAIT_SLICE = 1.0
# While nothing is wrong, a look younger than this is still good: small, fast batches (tens per
# second) must not each cost a query over pg_stat_activity.
CHECK_INTERVAL = 0.1
# A session blocked by us mostly waits for a batch that is committing right now: look again soon,
# or the back-off costs more throughput than the lock did; then less and less often.
LOCKS_POLL_INTERVAL = 0.02


class StopSignal(Protocol):
    """What ends a wait early: a ``threading.Event``, or anything that behaves like one."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass(frozen=True)
class ThrottleLimits:
    max_replica_lag: float | None = None
    critical_replica_lag: float | None = None
    max_active_sessions: int | None = None
    critical_active_sessions: int | None = None
    watch_locks: bool = True  # back off when application sessions wait on our batches' row locks

    @property
    def watches_lag(self) -> bool:
        return self.max_replica_lag is not None or self.critical_replica_lag is not None

    @property
    def watches_load(self) -> bool:
        return self.max_active_sessions is not None or self.critical_active_sessions is not None


@dataclass
class ThrottleState:
    """One look at the database and the operator's switch, and why the drain must wait (or not)."""

    reason: str | None = None
    control: ThrottleControl = field(default_factory=ThrottleControl)
    replica_lag: float | None = None  # seconds, the furthest-behind replica (None: not measured)
    lagging: str | None = None  # the replica that makes us wait
    sessions: int | None = None
    blocked: int | None = None

    def fields(self) -> dict[str, Any]:
        return {"reason": self.reason, "replica": self.lagging,
                "replica_lag_s": None if self.replica_lag is None else round(self.replica_lag, 3),
                "active_sessions": self.sessions, "blocked_sessions": self.blocked,
                "control_invalid": self.control.invalid}


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _sleep(stop: StopSignal, seconds: float, deadline: float | None) -> None:
    if deadline is not None:
        seconds = min(seconds, deadline - time.monotonic())
    if seconds > 0:
        stop.wait(seconds)


class Throttle:
    """Waits between batches while the database is unwell or an operator paused the run.

    One per run, shared by every drain worker (thread-safe). ``before_batch`` never fails for a
    limit that is merely exceeded: it waits, logs when waiting starts and ends, and counts the
    seconds per reason; a ``critical_*`` limit raises ``ThrottleCritical`` instead. ``tables``:
    the drained tables (``table`` or ``schema.table``), whose row-lock waits make it back off;
    empty: any table's.
    """

    def __init__(self, engine: sa.Engine, sizer: BatchSizer, limits: ThrottleLimits = ThrottleLimits(), *,
                 replicas: Sequence[str] | None = None, control: ThrottleControlSource | None = None,
                 delay: float = 0.0, poll_interval: float = POLL_INTERVAL, check_interval: float = CHECK_INTERVAL,
                 application_name: str = APPLICATION_NAME, run_id: str = "", tables: Sequence[str] = ()) -> None:
        self.engine = engine
        self.sizer = sizer
        self.limits = limits
        self.control_source = control
        self.delay = delay
        self.poll_interval = poll_interval
        self.check_interval = check_interval
        self.application_name = application_name
        self.run_id = run_id
        self.tables = tuple(tables)
        self.lag_meter = ReplicaLagMeter(replicas) if limits.watches_lag else None
        self.waited: dict[str, float] = dict.fromkeys(REASONS, 0.0)
        self.last_state = ThrottleState()
        self._control = ThrottleControl()  # the operator's control as last read
        self._check = threading.Lock()  # one look at the database at a time
        self._counts = threading.Lock()
        self._waiting_since: float | None = None
        self._checked_at: float | None = None
        self._reported_problems: dict[str, str] = {}

    @classmethod
    def from_settings(cls, engine: sa.Engine, settings: Settings, *, control: ThrottleControlSource | None = None,
                      run_id: str = "") -> Throttle:
        job = settings.job
        sizer = BatchSizer(job.first_batch_size, target=job.adaptive_batch_target, minimum=job.batch_size_min,
                           maximum=job.batch_size_max)
        limits = ThrottleLimits(max_replica_lag=job.max_replica_lag, critical_replica_lag=job.critical_replica_lag,
                                max_active_sessions=job.max_active_sessions,
                                critical_active_sessions=job.critical_active_sessions)
        return cls(engine, sizer, limits, replicas=settings.database.replicas, control=control,
                   delay=job.inter_batch_delay, run_id=run_id, tables=[t.table for t in settings.targets])

    @property
    def batch_size(self) -> int:
        return self.sizer.size

    def state(self) -> dict[str, Any]:
        """The throttle as a progress display shows it (plain JSON values, names and numbers only).

        ``status``: ``running``, ``paused``, ``waiting_for_lag``, ``waiting_for_load`` or
        ``waiting_for_locks``, as of the last look; ``batch_size``: of the next batch;
        ``batch_size_cap``: the size at which application sessions were blocked (adaptive growth
        stops there; None: never); ``waited_s``: seconds waited so far this run, by reason.
        """
        last = self.last_state
        if last.reason is None:
            status = "running"
        elif last.reason == REASON_PAUSED:
            status = "paused"
        else:
            status = f"waiting_for_{last.reason}"
        with self._counts:
            waited = {reason: round(seconds, 3) for reason, seconds in self.waited.items()}
        return {"status": status, "batch_size": self.sizer.size, "batch_size_cap": self.sizer.blocked_at,
                "operator_batch_size": last.control.batch_size, "operator_delay_s": last.control.delay,
                "control_invalid": last.control.invalid, "replica": last.lagging,
                "replica_lag_s": None if last.replica_lag is None else round(last.replica_lag, 3),
                "active_sessions": last.sessions, "blocked_sessions": last.blocked, "waited_s": waited}

    def batch_done(self, seconds: float, rows: int) -> None:
        """A batch of ``rows`` committed ``seconds`` after its rows were locked."""
        self.sizer.observe(seconds, rows)

    def before_batch(self, stop: StopSignal, deadline: float | None = None, *, first: bool = False) -> None:
        """Return when the next batch may start, or at once when ``stop`` is set or ``deadline``
        (a ``time.monotonic()`` value) has passed. ``first``: no batch went before, so no pause
        between batches is due. Raises ``ThrottleCritical`` past a critical limit, ``DatabaseError``
        when the primary cannot be asked."""
        since = time.monotonic()  # the pause between batches counts from here
        halved = False
        poll, waiting_for = 0.0, None
        while not stop.is_set() and not _passed(deadline):
            state = self._recent() or self.check()
            if state.reason is None:
                if first or self._between_batches(stop, since, deadline):
                    return
                continue  # the operator paused during the pause between batches: look again
            if state.reason == REASON_LOCKS and not halved:
                self.sizer.halve()  # smaller batches hold fewer rows for less time
                halved = True
                log_event("throttle_backoff", level=logging.INFO, run_id=self.run_id or None,
                          batch_size=self.sizer.size, batch_size_cap=self.sizer.blocked_at,
                          blocked_sessions=state.blocked)
            if state.reason != waiting_for:  # back off exponentially while the reason stays
                poll, waiting_for = (min(self.poll_interval, LOCKS_POLL_INTERVAL) if state.reason == REASON_LOCKS
                                     else self.poll_interval), state.reason
            else:
                poll = min(2 * poll, MAX_WAIT_SLICE)
            started = time.monotonic()
            _sleep(stop, min(poll, MAX_WAIT_SLICE), deadline)
            self._count(state.reason, time.monotonic() - started)

    def _between_batches(self, stop: StopSignal, since: float, deadline: float | None) -> bool:
        """Sleep out the pause between batches (the operator's delay, else ``inter_batch_delay``)
        in slices that re-read the operator's control. False: the control says pause now."""
        control = self.last_state.control
        while not stop.is_set() and not control.paused:
            delay = self.delay if control.delay is None else control.delay
            left = since + delay - time.monotonic()
            if left <= 0 or _passed(deadline):
                return True
            _sleep(stop, min(left, MAX_WAIT_SLICE), deadline)
            control = self._read_control()
        return stop.is_set()

    def _recent(self) -> ThrottleState | None:
        """The last look, when it found nothing wrong, is younger than ``check_interval``, and the
        operator's control has not changed since."""
        with self._check:
            if self.last_state.reason is None and self._checked_at is not None \
                    and time.monotonic() - self._checked_at < self.check_interval \
                    and self.last_state.control == self._control:
                return self.last_state
        return None

    def check(self) -> ThrottleState:
        """One look: the operator's switch, replica lag, busy sessions, sessions blocked by us."""
        control = self._read_control()
        with self._check:
            state = ThrottleState(control=control, reason=REASON_PAUSED if control.paused else None)
            self._look_at_database(state)
            self._transition(state)
            self.last_state = state
            self._checked_at = time.monotonic()
            return state

    def _read_control(self) -> ThrottleControl:
        """The operator's control as of now (asked outside our locks); the sizer follows its batch size."""
        control = parse_control(self.control_source()) if self.control_source is not None else ThrottleControl()
        with self._check:
            previous, self._control = self._control, control
            self.sizer.override(control.batch_size)
        if control.invalid and control.invalid != previous.invalid:
            log_event("throttle_control_invalid", level=logging.WARNING, run_id=self.run_id or None,
                      problem=control.invalid)
        if (control.batch_size, control.delay) != (previous.batch_size, previous.delay):
            log_event("throttle_control_changed", run_id=self.run_id or None, batch_size=control.batch_size,
                      delay=control.delay)
        return control

    def _look_at_database(self, state: ThrottleState) -> None:
        """The database's part of one look, on a connection of the engine (an engine's subclass
        reads its own signals: ``throttle.mysql``)."""
        try:
            with raw_connection(self.engine) as conn:
                self._look(conn, state)
        except psycopg.Error as e:
            raise DatabaseError(f"cannot read the database's health ({describe_db_error(e)})") from None

    def _look(self, conn: psycopg.Connection[Any], state: ThrottleState) -> None:
        lim, meter = self.limits, self.lag_meter
        signals = read_signals(conn, wal=meter is not None, standbys=meter is not None and meter.discovers,
                               busy=lim.watches_load, blocked=lim.watch_locks, tables=self.tables,
                               application_name=self.application_name)
        if meter is not None:
            lags = meter.measure(conn, signals)
            self._report_problems(meter.problems())
            self._judge_lag(state, lags)
        if signals.busy is not None:
            self._judge_load(state, signals.busy)
        if signals.blocked is not None:
            state.blocked = signals.blocked
            if state.reason is None and state.blocked:
                state.reason = REASON_LOCKS

    def _judge_lag(self, state: ThrottleState, lags: dict[str, float | None]) -> None:
        """Wait (or stop, past the critical limit) on the replicas' lag, None: not known (fail-safe)."""
        lim = self.limits
        known = {name: lag for name, lag in lags.items() if lag is not None}
        state.replica_lag = max(known.values()) if known else (0.0 if not lags else None)
        worst = max(known, key=lambda n: known[n]) if known else None
        if lim.critical_replica_lag is not None and state.replica_lag is not None \
                and state.replica_lag > lim.critical_replica_lag:
            state.reason, state.lagging = REASON_LAG, worst
            self._critical(state, f"replica {worst} is {state.replica_lag:.1f} s behind, above "
                                  f"job.critical_replica_lag ({lim.critical_replica_lag:g} s)")
        unknown = sorted(name for name, lag in lags.items() if lag is None)
        if state.reason is None and lim.max_replica_lag is not None:
            if unknown:
                # Fail-safe: a replica whose position we cannot read might be far behind.
                state.reason, state.lagging = REASON_LAG, unknown[0]
            elif state.replica_lag is not None and state.replica_lag > lim.max_replica_lag:
                state.reason, state.lagging = REASON_LAG, worst

    def _judge_load(self, state: ThrottleState, busy: int) -> None:
        """Wait (or stop, past the critical limit) on the sessions busy now."""
        lim = self.limits
        state.sessions = busy
        if lim.critical_active_sessions is not None and state.sessions > lim.critical_active_sessions:
            self._critical(state, f"{state.sessions} active sessions, above job.critical_active_sessions "
                                  f"({lim.critical_active_sessions})")
        if state.reason is None and lim.max_active_sessions is not None and state.sessions > lim.max_active_sessions:
            state.reason = REASON_LOAD

    def _critical(self, state: ThrottleState, message: str) -> None:
        log_event("throttle_critical", level=logging.ERROR, run_id=self.run_id or None, **state.fields())
        raise ThrottleCritical(f"stopped fail-safe: {message}")

    def _transition(self, state: ThrottleState) -> None:
        previous = self.last_state
        if state.reason == previous.reason:
            return
        now = time.monotonic()
        if previous.reason is not None:
            waited = now - self._waiting_since if self._waiting_since is not None else 0.0
            log_event("throttle_resumed", run_id=self.run_id or None, after=previous.reason, waited_s=round(waited, 3))
        if state.reason is not None:
            self._waiting_since = now
            log_event("throttle_waiting", level=logging.WARNING if state.reason != REASON_LOCKS else logging.INFO,
                      run_id=self.run_id or None, **state.fields())
        else:
            self._waiting_since = None

    def _report_problems(self, problems: dict[str, str]) -> None:
        for name, problem in problems.items():
            if self._reported_problems.get(name) != problem:
                log_event("replica_lag_unknown", level=logging.WARNING, run_id=self.run_id or None, replica=name,
                          problem=problem)
        self._reported_problems = dict(problems)

    def _count(self, reason: str, seconds: float) -> None:
        with self._counts:
            self.waited[reason] += seconds

    def record(self, metrics: RotationMetrics) -> None:
        """Fold this run's waits and last-seen figures into the run's metrics."""
        with self._counts:
            waited = dict(self.waited)
        for reason, seconds in waited.items():
            metrics.add_throttled(reason, seconds)
        metrics.set_batch_size(self.sizer.size)
        if self.last_state.replica_lag is not None:
            metrics.set_replica_lag(self.last_state.replica_lag)

    def close(self) -> None:
        if self.lag_meter is not None:
            self.lag_meter.close()
