"""What the throttle reads on MySQL / MariaDB, as gh-ost does: ``Threads_running`` as the load
signal, replica lag from each replica's own status (or a heartbeat), and the single-instance
advisory lock (``GET_LOCK``). Read-only except the lock; knows nothing of limits or waiting."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pymysql

from ...errors import DatabaseError
from ..base.checks import LoadSample, ReplicaPosition
from .connect import MySqlConnection, describe_db_error
from .replication import replica_status

SINGLE_INSTANCE_LOCK = "Pin:lock:job:scheduled:profile-reencrypt"


class MySqlThrottleSignals:
    def load(self, conn: MySqlConnection) -> LoadSample:
        """``Threads_running`` (server-wide; the reading session counts itself) and ``Threads_connected``."""
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW GLOBAL STATUS WHERE Variable_name IN ('Threads_running', 'Threads_connected')")
                status = {str(k): int(v) for k, v in cur.fetchall()}
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"cannot read Threads_running ({describe_db_error(e)})") from None
        return LoadSample(status["Threads_running"], {"threads_connected": status.get("Threads_connected")})

    def replica_lag(self, conn: MySqlConnection) -> list[ReplicaPosition]:
        """Asked of each replica (a connection to it): ``Seconds_Behind_Master`` /
        ``Seconds_Behind_Source``; None when its replication is not running (fail closed: the
        caller waits or stops, it never reads None as caught up)."""
        return replica_status(conn)


class MySqlAdvisoryLock:
    @contextlib.contextmanager
    def held(self, conn: MySqlConnection, name: str = SINGLE_INSTANCE_LOCK) -> Iterator[bool]:
        """``GET_LOCK(name, 0)``: True while this session holds it, False at once when another
        session does. Server-wide (not per database), released by ``RELEASE_LOCK`` or when the
        session ends; ``conn`` must stay open for as long as the lock is meant to be held."""
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT GET_LOCK(%s, 0)", (name,))
                row = cur.fetchone()
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"cannot take the advisory lock ({describe_db_error(e)})") from None
        got = bool(row and row[0] == 1)
        try:
            yield got
        finally:
            if got:
                with contextlib.suppress(pymysql.err.MySQLError), conn.cursor() as cur:
                    cur.execute("SELECT RELEASE_LOCK(%s)", (name,))


THROTTLE_SIGNALS = MySqlThrottleSignals()
ADVISORY_LOCK = MySqlAdvisoryLock()
