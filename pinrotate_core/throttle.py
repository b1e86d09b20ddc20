"""Sharing the database politely: adaptive batch size, replica-lag and load waits, pause from outside.

Called by a drain's reader thread before it begins (and locks) the next batch
(``Throttle.before_batch``), never while it holds that batch's rows: it only waits (counting and
logging the wait) or, past a ``critical_*`` limit, raises ``ThrottleCritical``. It never writes to
the database and knows nothing of the orchestrator: a pause / tune source is a plain callable
handed in (flows/throttle.py reads a Prefect Variable); ``Throttle.state()`` is what a progress
display shows.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
import sqlalchemy as sa

from .db import describe_db_error, raw_connection, redacted
from .errors import DatabaseError, ThrottleCritical
from .log import log_event

if TYPE_CHECKING:
    from .config import Settings
    from .metrics import RotationMetrics

REASON_PAUSED = "paused"
REASON_LAG = "lag"
REASON_LOAD = "load"
REASON_LOCKS = "locks"
REASONS = (REASON_LAG, REASON_LOAD, REASON_LOCKS, REASON_PAUSED)

APPLICATION_NAME = "pinrotate"  # how our own backends are told apart (db.make_engine sets it)
POLL_INTERVAL = 0.5  # seconds between two looks at the database while waiting
# While nothing is wrong, a look younger than this is still good: small, fast batches (tens per
# second) must not each cost a query over pg_stat_activity.
CHECK_INTERVAL = 0.1
# A session blocked by us mostly waits for a batch that is committing right now: look again soon,
# or the back-off costs more throughput than the lock did.
LOCKS_POLL_INTERVAL = 0.02
MAX_LAG_SAMPLES = 100_000  # (time, LSN) pairs kept while a replica is behind (~14 h at one per 0.5 s)
REPLICA_CONNECT_TIMEOUT = 5  # seconds

ThrottleControlSource = Callable[[], Any]  # returns a mapping like {"paused": true}, its JSON, or None


class StopSignal(Protocol):
    """What ends a wait early: a ``threading.Event``, or anything that behaves like one."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


# -- batch size ------------------------------------------------------------------------------


class BatchSizer:
    """The size of the next batch: fixed, or following recent batch times toward a target.

    Adaptive (GitLab's batched background migrations): the size moves by the ratio of the target
    to the time a batch of this size takes by the moving average of the last ``window`` batches
    (per row, so that batches of other sizes count alike), at most +10% / -20% per batch, inside
    ``[minimum, maximum]``. ``halve`` backs off at once (application sessions wait on our locks);
    a fixed size then grows back by 10% per batch to where it was, an adaptive size grows back no
    further than the size at which sessions were blocked (``blocked_at``, the lowest seen this run:
    batch times alone do not show what our locks cost the application). An operator's ``override``
    wins while it is set. Thread-safe: the workers of a drain share one sizer.
    """

    GROW = 1.10
    SHRINK = 0.80
    DEADBAND = 0.05  # within 5% of the target: keep the size

    def __init__(self, batch_size: int, *, target: float | None = None, minimum: int = 50, maximum: int = 5000,
                 window: int = 5) -> None:
        if batch_size <= 0 or minimum <= 0 or maximum < minimum or window <= 0:
            raise ValueError("batch sizes must be > 0 with minimum <= maximum, window > 0")
        if target is not None and target <= 0:
            raise ValueError("batch time target must be > 0")
        self.target = target
        # A fixed size below the adaptive floor stays allowed (and is its own floor).
        self.minimum = min(minimum, batch_size)
        self.maximum = max(maximum, batch_size) if target is None else maximum
        self._ceiling = batch_size if target is None else maximum
        self._size = max(self.minimum, min(batch_size, self.maximum))
        self._times: deque[float] = deque(maxlen=window)
        self._override: int | None = None
        self.blocked_at: int | None = None  # adaptive: the smallest size at which our locks blocked a session
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        with self._lock:
            return self._override if self._override is not None else self._size

    def override(self, size: int | None) -> None:
        """An operator's batch size (None: back to the sizer's own)."""
        if size is not None and size <= 0:
            raise ValueError("batch size override must be > 0")
        with self._lock:
            self._override = size

    def observe(self, seconds: float, rows: int) -> None:
        """One batch of ``rows`` rows took ``seconds`` from locking its rows to its commit."""
        if seconds < 0 or rows < 0:
            raise ValueError("batch time and rows must be >= 0")
        with self._lock:
            self._times.append(seconds / max(rows, 1))
            if self.target is None:
                # Fixed: only recover from a halving, 10% per batch.
                self._size = min(self._ceiling, self._scaled(self.GROW))
                return
            average = self._size * sum(self._times) / len(self._times)  # a batch of the current size
            if abs(average - self.target) <= self.DEADBAND * self.target:
                return
            ratio = self.target / average if average > 0 else self.GROW
            size = self._bounded(self._scaled(min(self.GROW, max(self.SHRINK, ratio))))
            if self.blocked_at is not None and size > self._size:
                size = max(self._size, min(size, self.blocked_at))  # grow no further than where we blocked
            self._size = size

    def halve(self) -> None:
        """Application sessions wait on our locks: back off at once (and, adaptive, remember where)."""
        with self._lock:
            if self.target is not None:
                self.blocked_at = self._size if self.blocked_at is None else min(self.blocked_at, self._size)
            self._size = self._bounded(self._size // 2)
            # Recent times were measured at the old size: start the average afresh.
            self._times.clear()

    def _scaled(self, factor: float) -> int:
        # Rounded toward the old size, so a step never exceeds its bound (but moves by one row at least).
        if factor >= 1:
            return max(self._size + 1, math.floor(self._size * factor))
        return min(self._size - 1, math.ceil(self._size * factor))

    def _bounded(self, size: int) -> int:
        return max(self.minimum, min(self.maximum, size))


# -- the operator's pause / tune switch ------------------------------------------------------


@dataclass(frozen=True)
class ThrottleControl:
    """What an operator asked for while the run is going: pause, a batch size, a delay."""

    paused: bool = False
    batch_size: int | None = None
    delay: float | None = None  # seconds between batches, instead of job.inter_batch_delay
    invalid: str | None = None  # why the source's value was refused (then: paused, fail-safe)


def parse_control(value: Any) -> ThrottleControl:
    """A control value (e.g. a Prefect Variable's JSON, or that JSON as a string) as a ``ThrottleControl``.

    Absent or empty: no control. A value that is not understood pauses the drain (fail-safe: an
    operator who meant to pause must not get full speed from a typo) and says which field is wrong.
    """
    if isinstance(value, str):
        if not value.strip():
            return ThrottleControl()
        try:
            value = json.loads(value)
        except ValueError:
            return ThrottleControl(paused=True, invalid="not valid JSON")
    if value is None:
        return ThrottleControl()
    if not isinstance(value, Mapping):
        return ThrottleControl(paused=True, invalid="not a JSON object")
    unknown = sorted(set(value) - {"paused", "batch_size", "delay"})
    if unknown:
        return ThrottleControl(paused=True, invalid=f"unknown field {unknown[0]}")
    paused = value.get("paused", False)
    if not isinstance(paused, bool):
        return ThrottleControl(paused=True, invalid="paused must be true or false")
    size = value.get("batch_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        return ThrottleControl(paused=True, invalid="batch_size must be a positive integer or null")
    delay = value.get("delay")
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0):
        return ThrottleControl(paused=True, invalid="delay must be a number of seconds >= 0 or null")
    return ThrottleControl(paused=paused, batch_size=size, delay=None if delay is None else float(delay))


# -- replica lag -----------------------------------------------------------------------------


def parse_lsn(text: str) -> int:
    """A ``pg_lsn`` (``16/B374D848``) as an integer."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


@dataclass
class ReplicaPosition:
    name: str
    replayed: int | None  # None: unknown (unreachable, not a replica, or not visible to our role)
    problem: str | None = None


class ReplicaLagMeter:
    """Replay lag in seconds, measured as "how long ago did the primary have WAL the replica lacks".

    It remembers (time, ``pg_current_wal_lsn()``) samples of the primary; a replica's lag is now
    minus the time of the oldest sample beyond the position it has replayed, and 0 when it has
    replayed the latest one. So a replica whose replay stopped lags more and more while the primary
    writes, and an idle primary (a throttled drain writes nothing) shows no lag at all, which
    ``pg_stat_replication.replay_lag`` (kept at its last value) and ``now() -
    pg_last_xact_replay_timestamp()`` (grows while idle) both get wrong.
    """

    def __init__(self, replica_urls: Sequence[str] | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_urls = tuple(replica_urls) if replica_urls else ()
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque(maxlen=MAX_LAG_SAMPLES)
        self._conns: dict[str, psycopg.Connection[Any]] = {}
        self._problems: dict[str, str] = {}

    def measure(self, primary: psycopg.Connection[Any]) -> dict[str, float | None]:
        """Lag per replica (seconds; None when its position cannot be read) after one new sample."""
        row = primary.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        now = self._clock()
        current = parse_lsn(str(row[0])) if row else 0
        if not self._samples or self._samples[-1][1] != current:
            self._samples.append((now, current))
        positions = self._configured() if self.replica_urls else self._discovered(primary)
        lags: dict[str, float | None] = {}
        for pos in positions:
            lags[pos.name] = None if pos.replayed is None else self._lag(pos.replayed, now)
        known = [p.replayed for p in positions if p.replayed is not None]
        if known and len(known) == len(positions):
            self._forget_through(min(known))
        return lags

    def problems(self) -> dict[str, str]:
        """Why the position of a replica could not be read, by replica, as of the last measure."""
        return dict(self._problems)

    def _lag(self, replayed: int, now: float) -> float:
        for when, lsn in self._samples:
            if lsn > replayed:
                return max(0.0, now - when)
        return 0.0

    def _forget_through(self, replayed: int) -> None:
        # Samples every replica has replayed can no longer define anyone's lag; keep the last one.
        while len(self._samples) > 1 and self._samples[0][1] <= replayed:
            self._samples.popleft()

    def _discovered(self, primary: psycopg.Connection[Any]) -> list[ReplicaPosition]:
        rows = primary.execute(
            "SELECT coalesce(nullif(application_name, ''), 'walreceiver') || '@' ||"
            " coalesce(host(client_addr), 'local') || ':' || pid, replay_lsn::text"
            " FROM pg_stat_replication ORDER BY pid").fetchall()
        out = []
        problems: dict[str, str] = {}
        for name, lsn in rows:
            if lsn is None:
                # Streaming but not replaying yet, or our role may not read the column (pg_monitor).
                problems[str(name)] = "replay_lsn not readable (grant pg_monitor to the role)"
            out.append(ReplicaPosition(str(name), None if lsn is None else parse_lsn(str(lsn)),
                                       problems.get(str(name))))
        self._problems = problems
        return out

    def _configured(self) -> list[ReplicaPosition]:
        out = []
        problems: dict[str, str] = {}
        for url in self.replica_urls:
            name = redacted(url)
            try:
                conn = self._conns.get(url)
                if conn is None or conn.closed:
                    conn = psycopg.connect(url, autocommit=True, application_name=APPLICATION_NAME,
                                           connect_timeout=REPLICA_CONNECT_TIMEOUT)
                    self._conns[url] = conn
                row = conn.execute("SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text").fetchone()
            except psycopg.Error as e:
                self._drop(url)
                problems[name] = f"unreachable ({describe_db_error(e)})"
                out.append(ReplicaPosition(name, None, problems[name]))
                continue
            if not row or not row[0] or row[1] is None:
                problems[name] = "not a streaming replica (pg_is_in_recovery() is false)"
                out.append(ReplicaPosition(name, None, problems[name]))
                continue
            out.append(ReplicaPosition(name, parse_lsn(str(row[1]))))
        self._problems = problems
        return out

    def _drop(self, url: str) -> None:
        conn = self._conns.pop(url, None)
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def close(self) -> None:
        for url in list(self._conns):
            self._drop(url)


# -- load ------------------------------------------------------------------------------------


def busy_sessions(conn: psycopg.Connection[Any], application_name: str = APPLICATION_NAME) -> int:
    """Client sessions running a statement now, over the whole server, ours left out.

    Sessions of other roles show their state only to superusers and members of pg_read_all_stats
    (pg_monitor): grant it to the rotation's role or the count is too low.
    """
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND backend_type = 'client backend'"
        " AND pid <> pg_backend_pid() AND application_name IS DISTINCT FROM %s", (application_name,)).fetchone()
    return int(row[0]) if row else 0


def sessions_blocked_by_us(conn: psycopg.Connection[Any], application_name: str = APPLICATION_NAME) -> int:
    """Other sessions waiting for a lock that one of our backends holds (``pg_blocking_pids``)."""
    # pg_blocking_pids is asked only about sessions that wait on a lock at all (it takes the lock
    # manager's partition locks); MATERIALIZED keeps the planner from calling it on every session.
    row = conn.execute(
        "WITH waiting AS MATERIALIZED ("
        " SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        " AND application_name IS DISTINCT FROM %s)"
        " SELECT count(*) FROM waiting w WHERE EXISTS ("
        " SELECT 1 FROM pg_stat_activity holder WHERE holder.pid = ANY(pg_blocking_pids(w.pid))"
        " AND holder.application_name = %s)", (application_name, application_name)).fetchone()
    return int(row[0]) if row else 0


# -- the throttle ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ThrottleLimits:
    max_replica_lag: float | None = None
    critical_replica_lag: float | None = None
    max_active_sessions: int | None = None
    critical_active_sessions: int | None = None
    watch_locks: bool = True  # back off when application sessions wait on our locks

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


class Throttle:
    """Waits between batches while the database is unwell or an operator paused the run.

    One per run, shared by every drain worker (thread-safe). ``before_batch`` never fails for a
    limit that is merely exceeded: it waits, logs when waiting starts and ends, and counts the
    seconds per reason; a ``critical_*`` limit raises ``ThrottleCritical`` instead.
    """

    def __init__(self, engine: sa.Engine, sizer: BatchSizer, limits: ThrottleLimits = ThrottleLimits(), *,
                 replicas: Sequence[str] | None = None, control: ThrottleControlSource | None = None,
                 delay: float = 0.0, poll_interval: float = POLL_INTERVAL, check_interval: float = CHECK_INTERVAL,
                 application_name: str = APPLICATION_NAME, run_id: str = "") -> None:
        self.engine = engine
        self.sizer = sizer
        self.limits = limits
        self.control_source = control
        self.delay = delay
        self.poll_interval = poll_interval
        self.check_interval = check_interval
        self.application_name = application_name
        self.run_id = run_id
        self.lag_meter = ReplicaLagMeter(replicas) if limits.watches_lag else None
        self.waited: dict[str, float] = dict.fromkeys(REASONS, 0.0)
        self.last_state = ThrottleState()
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
                   delay=job.inter_batch_delay, run_id=run_id)

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
        halved = False
        while not stop.is_set():
            state = self._recent() or self.check()
            if state.reason is None:
                break
            if state.reason == REASON_LOCKS and not halved:
                self.sizer.halve()  # smaller batches hold fewer rows for less time
                halved = True
                log_event("throttle_backoff", level=logging.INFO, run_id=self.run_id or None,
                          batch_size=self.sizer.size, batch_size_cap=self.sizer.blocked_at,
                          blocked_sessions=state.blocked)
            if deadline is not None and time.monotonic() >= deadline:
                return
            started = time.monotonic()
            stop.wait(min(self.poll_interval, LOCKS_POLL_INTERVAL) if state.reason == REASON_LOCKS
                      else self.poll_interval)
            self._count(state.reason, time.monotonic() - started)
        delay = self.last_state.control.delay
        delay = self.delay if delay is None else delay
        if delay and not first and not stop.is_set():
            stop.wait(delay)

    def _recent(self) -> ThrottleState | None:
        """The last look, when it found nothing wrong and is younger than ``check_interval``."""
        with self._check:
            if self.last_state.reason is None and self._checked_at is not None \
                    and time.monotonic() - self._checked_at < self.check_interval:
                return self.last_state
        return None

    def check(self) -> ThrottleState:
        """One look: the operator's switch, replica lag, busy sessions, sessions blocked by us."""
        with self._check:
            control = parse_control(self.control_source()) if self.control_source is not None else ThrottleControl()
            self.sizer.override(control.batch_size)
            state = ThrottleState(control=control)
            if control.paused:
                state.reason = REASON_PAUSED
            try:
                with raw_connection(self.engine) as conn:
                    self._look(conn, state)
            except psycopg.Error as e:
                raise DatabaseError(f"cannot read the database's health ({describe_db_error(e)})") from None
            self._transition(state)
            self.last_state = state
            self._checked_at = time.monotonic()
            return state

    def _look(self, conn: psycopg.Connection[Any], state: ThrottleState) -> None:
        lim = self.limits
        if self.lag_meter is not None:
            lags = self.lag_meter.measure(conn)
            self._report_problems(self.lag_meter.problems())
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
        if lim.watches_load:
            state.sessions = busy_sessions(conn, self.application_name)
            if lim.critical_active_sessions is not None and state.sessions > lim.critical_active_sessions:
                self._critical(state, f"{state.sessions} active sessions, above job.critical_active_sessions "
                                      f"({lim.critical_active_sessions})")
            if state.reason is None and lim.max_active_sessions is not None and state.sessions > lim.max_active_sessions:
                state.reason = REASON_LOAD
        if lim.watch_locks and state.reason is None:
            state.blocked = sessions_blocked_by_us(conn, self.application_name)
            if state.blocked:
                state.reason = REASON_LOCKS

    def _critical(self, state: ThrottleState, message: str) -> None:
        log_event("throttle_critical", level=logging.ERROR, run_id=self.run_id or None, **state.fields())
        raise ThrottleCritical(f"stopped fail-safe: {message}")

    def _transition(self, state: ThrottleState) -> None:
        previous = self.last_state
        if state.control.invalid and state.control.invalid != previous.control.invalid:
            log_event("throttle_control_invalid", level=logging.WARNING, run_id=self.run_id or None,
                      problem=state.control.invalid)
        if (state.control.batch_size, state.control.delay) != (previous.control.batch_size, previous.control.delay):
            log_event("throttle_control_changed", run_id=self.run_id or None, batch_size=state.control.batch_size,
                      delay=state.control.delay)
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
