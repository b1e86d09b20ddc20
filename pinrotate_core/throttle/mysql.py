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
- Row-lock waits: application sessions waiting for a row of a drained table that a draining
  session holds locked (between a batch's lock and its commit; the guard itself never waits on
  a row: ``SKIP LOCKED``), as on PostgreSQL: the drain waits and its batches grow no further.
  Draining sessions are known by their named lock (``engines/mysql/signals.drain_session``).
  A role that may not see lock waits (no ``PROCESS``) is told once in the log and not watched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pymysql
import sqlalchemy as sa

from ..db import redacted
from ..engines.mysql import connect as mysql_connect
from ..engines.mysql.signals import THROTTLE_SIGNALS, LockWaitsHidden, sessions_blocked_by_drains
from ..errors import DatabaseError
from ..log import log_event
from .waiting import REASON_LOCKS, Throttle, ThrottleState

ATTACHED = "replicas attached"  # the name of the replicas the primary serves but no URL names


class MySqlThrottle(Throttle):
    def __init__(self, engine: sa.Engine, *args: Any, replicas: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(engine, *args, replicas=None, **kwargs)
        self.lag_meter = None  # PostgreSQL's WAL meter: replaced by each replica's own status
        self.locks_hidden: str | None = None  # why the row-lock waits cannot be watched (logged once)
        self.replica_urls = tuple(replicas) if replicas is not None else None
        self._replica_engines: dict[str, sa.Engine] = {}
        self._problems: dict[str, str] = {}

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
        for url in self.replica_urls:
            name = redacted(url)
            try:
                engine = self._replica_engines.get(url)
                if engine is None:
                    engine = self._replica_engines[url] = mysql_connect.make_engine(url, pool_size=1)
                with mysql_connect.raw_connection(engine) as conn:
                    positions = THROTTLE_SIGNALS.replica_lag(conn)
            except DatabaseError as e:
                lags[name], self._problems[name] = None, f"unreachable ({e})"
                continue
            if not positions:
                lags[name], self._problems[name] = None, "not a replica (no replication status)"
                continue
            behind = [p.lag_s for p in positions]
            if any(lag is None for lag in behind):
                lags[name] = None
                self._problems[name] = next(p.problem or "lag not known" for p in positions if p.lag_s is None)
            else:
                lags[name] = max(lag for lag in behind if lag is not None)
        return lags

    def _attached(self) -> int:
        try:
            with mysql_connect.raw_connection(self.engine) as conn, conn.cursor() as cur:
                cur.execute("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%%'", ())
                row = cur.fetchone()
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"cannot read the database's health ({mysql_connect.describe_db_error(e)})") from None
        return int(row[0]) if row else 0

    def close(self) -> None:
        for engine in self._replica_engines.values():
            engine.dispose()
        self._replica_engines.clear()
        super().close()
