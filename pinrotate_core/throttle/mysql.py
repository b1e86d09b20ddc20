"""The throttle on MySQL / MariaDB: the same limits, waits, operator control and log lines as on
PostgreSQL (``waiting.Throttle``), over MySQL's own signals (``engines/mysql/signals.py``).

- Load: ``Threads_running`` (server-wide, as gh-ost's ``max-load``) less the session that reads it,
  against ``job.max_active_sessions`` / ``job.critical_active_sessions``. It counts every session
  running a statement at that moment, the run's own writers included (there is no application
  name to leave them out by).
- Replica lag: each replica of ``database.replicas`` (``mysql://`` / ``mariadb://`` URLs) asked for
  its own ``Seconds_Behind_Master`` / ``Seconds_Behind_Source``; a replica that cannot be asked, or
  whose replication is not running, is lag unknown (fail-safe: the drain waits). Without
  configured replicas, replicas reading this server's binary log (``Binlog Dump`` threads) cannot be
  reached from the primary's URL: their lag is unknown too, and the log says to name them.
  A run that writes also measures the lag as gh-ost does, by a heartbeat (``HeartbeatMeter``): each
  look stamps the run's own row of ``pinrotate.heartbeat`` on the primary, and a replica is as far
  behind as the oldest stamp it has not applied has waited, which the status misses when the
  replica's I/O thread has fallen behind. The larger of the two counts. Without the table (or the
  right to write it) the status alone counts, and the log says so once.
- Row-lock waits: application sessions waiting for a row of a drained table that a draining
  session holds locked (between a batch's lock and its commit; the guard itself never waits on
  a row: ``SKIP LOCKED``), as on PostgreSQL: the drain waits and its batches grow no further.
  Draining sessions are known by their named lock (``engines/mysql/signals.drain_session``).
  A role that may not see lock waits (no ``PROCESS``) is told once in the log and not watched.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pymysql
import sqlalchemy as sa

from ..db import redacted
from ..engines.mysql import connect as mysql_connect
from ..engines.mysql.replication import (
    HeartbeatUnavailable,
    binlog_readers,
    read_heartbeat,
    remove_heartbeat,
    write_heartbeat,
)
from ..engines.mysql.signals import THROTTLE_SIGNALS, LockWaitsHidden, sessions_blocked_by_drains
from ..errors import DatabaseError
from ..log import log_event
from .waiting import REASON_LOCKS, Throttle, ThrottleState

if TYPE_CHECKING:
    from ..config import Settings
    from .control import ThrottleControlSource

ATTACHED = "replicas attached"  # the name of the replicas the primary serves but no URL names


class HeartbeatMeter:
    """gh-ost's heartbeat without trusting any clock: ``stamp`` writes this writer's row on the
    primary and remembers when (monotonic); ``lag`` is how long the oldest stamp a replica has not
    applied yet has waited (0 when it holds the newest). Stamps are this process's own, strictly
    increasing, so comparing them needs no clock of another host."""

    KEPT = 100_000  # stamps remembered while a replica lags (hours at the throttle's pace)

    def __init__(self, writer: str) -> None:
        self.writer = writer
        self.off: str | None = None  # why the heartbeat is not used (logged once)
        self._sent: deque[tuple[datetime, float]] = deque(maxlen=self.KEPT)

    def stamp(self, primary: mysql_connect.MySqlConnection) -> None:
        stamp = datetime.now(UTC).replace(tzinfo=None)  # DATETIME(6), UTC
        if self._sent and stamp <= self._sent[-1][0]:
            stamp = self._sent[-1][0] + timedelta(microseconds=1)
        write_heartbeat(primary, self.writer, stamp)
        self._sent.append((stamp, time.monotonic()))

    def lag(self, applied: datetime | None) -> float | None:
        """Seconds behind, by the stamps; None before the first stamp was written."""
        if not self._sent:
            return None
        for stamp, sent in self._sent:  # oldest first
            if applied is None or stamp > applied:
                return time.monotonic() - sent
        return 0.0

    def applied_by_all(self, applied: Sequence[datetime | None]) -> None:
        """Forget the stamps every replica holds (the newest is always kept)."""
        if not applied or any(a is None for a in applied):
            return
        oldest = min(a for a in applied if a is not None)
        while len(self._sent) > 1 and self._sent[0][0] <= oldest:
            self._sent.popleft()


class MySqlThrottle(Throttle):
    def __init__(self, engine: sa.Engine, *args: Any, replicas: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(engine, *args, replicas=None, **kwargs)
        self.lag_meter = None  # PostgreSQL's WAL meter: replaced by each replica's own status
        self.locks_hidden: str | None = None  # why the row-lock waits cannot be watched (logged once)
        self.replica_urls = tuple(replicas) if replicas is not None else None
        self._replica_engines: dict[str, sa.Engine] = {}
        self._problems: dict[str, str] = {}
        self.heartbeat: HeartbeatMeter | None = None  # for_run(writes=True) with replicas named
        self._no_heartbeat: set[str] = set()  # replicas without the heartbeat table (logged once each)

    @classmethod
    def for_run(cls, engine: sa.Engine, settings: Settings, *, control: ThrottleControlSource | None, run_id: str,
                writes: bool) -> MySqlThrottle:
        """The run's throttle; only a run that writes stamps the heartbeat (a dry run writes nothing,
        not even this)."""
        throttle = cls.from_settings(engine, settings, control=control, run_id=run_id)
        assert isinstance(throttle, MySqlThrottle)
        if writes and throttle.replica_urls and throttle.limits.watches_lag:
            throttle.heartbeat = HeartbeatMeter(f"{(run_id or 'run')[:40]}-{uuid.uuid4().hex[:16]}")
        return throttle

    def _look_at_database(self, state: ThrottleState) -> None:
        try:
            self._look_mysql(state)
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"cannot read the database's health ({mysql_connect.describe_db_error(e)})") from None

    def _look_mysql(self, state: ThrottleState) -> None:
        lim = self.limits
        if lim.watches_lag:
            lags = self._replica_lags()
            self._report_problems(self._problems)
            self._judge_lag(state, lags)
        if lim.watches_load:
            with mysql_connect.raw_connection(self.engine) as conn:
                sample = THROTTLE_SIGNALS.load(conn)
            self._judge_load(state, max(0, sample.threads_running - 1))  # not the reading session itself
        if lim.watch_locks and self.locks_hidden is None:
            self._judge_locks(state)

    def _judge_locks(self, state: ThrottleState) -> None:
        try:
            with mysql_connect.raw_connection(self.engine) as conn:
                state.blocked = sessions_blocked_by_drains(conn, self.tables)
        except LockWaitsHidden as e:
            self.locks_hidden = str(e)
            log_event("throttle_signal_hidden", level=logging.WARNING, run_id=self.run_id or None,
                      signal="row_lock_waits", problem=self.locks_hidden)
            return
        if state.reason is None and state.blocked:
            state.reason = REASON_LOCKS

    def _replica_lags(self) -> dict[str, float | None]:
        self._problems = {}
        lags: dict[str, float | None] = {}
        if self.replica_urls is None:
            attached = self._attached()
            if attached:
                lags[ATTACHED] = None
                self._problems[ATTACHED] = (f"{attached} replica(s) read this server's binary log; name them in "
                                            "database.replicas so that their lag can be read")
            return lags
        beat = self._stamp()
        applied: list[datetime | None] = []
        for url in self.replica_urls:
            name = redacted(url)
            try:
                engine = self._replica_engines.get(url)
                if engine is None:
                    engine = self._replica_engines[url] = mysql_connect.make_engine(url, pool_size=1)
                with mysql_connect.raw_connection(engine) as conn:
                    positions = THROTTLE_SIGNALS.replica_lag(conn)
                    if beat is not None:
                        applied.append(self._applied(conn, name, beat))
            except DatabaseError as e:
                lags[name], self._problems[name] = None, f"unreachable ({e})"
                applied.append(None)
                continue
            if not positions:
                lags[name], self._problems[name] = None, "not a replica (no replication status)"
                continue
            behind = [p.lag_s for p in positions]
            if any(lag is None for lag in behind):
                lags[name] = None
                self._problems[name] = next(p.problem or "lag not known" for p in positions if p.lag_s is None)
                continue
            lags[name] = max(lag for lag in behind if lag is not None)
            by_stamps = beat.lag(applied[-1]) if beat is not None and name not in self._no_heartbeat else None
            if by_stamps is not None:
                lags[name] = max(lags[name] or 0.0, by_stamps)
        if beat is not None:
            beat.applied_by_all([a for url, a in zip(self.replica_urls, applied, strict=True)
                                 if redacted(url) not in self._no_heartbeat])
        return lags

    def _applied(self, conn: mysql_connect.MySqlConnection, name: str, beat: HeartbeatMeter) -> datetime | None:
        """The replica's copy of our stamp; a replica without the table is read by its status alone
        from then on (said once)."""
        if name in self._no_heartbeat:
            return None
        try:
            return read_heartbeat(conn, beat.writer)
        except HeartbeatUnavailable as e:
            self._no_heartbeat.add(name)
            log_event("throttle_signal_hidden", level=logging.WARNING, run_id=self.run_id or None,
                      signal="replica_heartbeat", replica=name, problem=str(e))
            if self.replica_urls and all(redacted(url) in self._no_heartbeat for url in self.replica_urls):
                beat.off = "no replica has the heartbeat table"  # nothing to stamp for any more
            return None

    def _stamp(self) -> HeartbeatMeter | None:
        """Stamp the heartbeat on the primary before the replicas are read; the meter, or None
        when there is none or it is off (said once in the log, the status alone counting)."""
        beat = self.heartbeat
        if beat is None or beat.off is not None:
            return None
        try:
            with mysql_connect.raw_connection(self.engine) as conn:
                beat.stamp(conn)
        except HeartbeatUnavailable as e:
            beat.off = str(e)
            log_event("throttle_signal_hidden", level=logging.WARNING, run_id=self.run_id or None,
                      signal="replica_heartbeat", problem=beat.off)
            return None
        return beat

    def _attached(self) -> int:
        try:
            with mysql_connect.raw_connection(self.engine) as conn:
                return binlog_readers(conn)
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"cannot read the database's health ({mysql_connect.describe_db_error(e)})") from None

    def close(self) -> None:
        if self.heartbeat is not None and self.heartbeat.lag(None) is not None:  # a stamp was written
            with contextlib.suppress(DatabaseError), mysql_connect.raw_connection(self.engine) as conn:
                remove_heartbeat(conn, self.heartbeat.writer)
        for engine in self._replica_engines.values():
            engine.dispose()
        self._replica_engines.clear()
        super().close()
