"""What the throttle reads on MySQL / MariaDB, as gh-ost does: ``Threads_running`` as the load
signal, replica lag from each replica's own status (or a heartbeat), application sessions waiting
on a row a drain holds locked, and the single-instance advisory lock (``GET_LOCK``). Read-only
except the locks; knows nothing of limits or waiting.

A drain's session is known by a named lock it holds while it drains (``drain_session``:
``GET_LOCK('pinrotate_drain_' || CONNECTION_ID())``): MySQL has no application name, and a named
lock is what any session can ask of another (``IS_USED_LOCK``) without ``performance_schema``
(off by default on MariaDB)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import pymysql

from ...errors import DatabaseError
from ..base.checks import LoadSample, ReplicaPosition
from .connect import MySqlConnection, describe_db_error, error_number, is_mariadb
from .replication import replica_status

SINGLE_INSTANCE_LOCK = "Pin:lock:job:scheduled:profile-reencrypt"
DRAIN_MARK = "pinrotate_drain_"  # + the session's CONNECTION_ID(): the named lock of a draining session

# Sessions waiting for a row lock of a drained table that a draining session holds (the waiting
# session not a drain itself). MariaDB keeps InnoDB's lock waits in information_schema, MySQL 8
# in performance_schema; both need the PROCESS privilege (MySQL: SELECT on performance_schema too).
_WAITS_MARIADB = (
    "SELECT COUNT(DISTINCT r.trx_mysql_thread_id) FROM information_schema.INNODB_LOCK_WAITS w"
    " JOIN information_schema.INNODB_LOCKS l ON l.lock_id = w.requested_lock_id"
    " JOIN information_schema.INNODB_TRX b ON b.trx_id = w.blocking_trx_id"
    " JOIN information_schema.INNODB_TRX r ON r.trx_id = w.requesting_trx_id"
    " WHERE l.lock_type = 'RECORD'")
_WAITS_MYSQL = (
    "SELECT COUNT(DISTINCT r.trx_mysql_thread_id) FROM performance_schema.data_lock_waits w"
    " JOIN performance_schema.data_locks l ON l.ENGINE_LOCK_ID = w.REQUESTING_ENGINE_LOCK_ID AND l.ENGINE = w.ENGINE"
    " JOIN information_schema.INNODB_TRX b ON b.trx_id = w.BLOCKING_ENGINE_TRANSACTION_ID"
    " JOIN information_schema.INNODB_TRX r ON r.trx_id = w.REQUESTING_ENGINE_TRANSACTION_ID"
    " WHERE l.LOCK_TYPE = 'RECORD'")
_BY_A_DRAIN = (" AND IS_USED_LOCK(CONCAT(%s, b.trx_mysql_thread_id)) = b.trx_mysql_thread_id"
               " AND IS_USED_LOCK(CONCAT(%s, r.trx_mysql_thread_id)) IS NULL")
# The table as each server names a lock's table: MariaDB `db`.`table`, MySQL schema and name apart.
_TABLE_MARIADB = "CONCAT('`', REPLACE(COALESCE(%s, DATABASE()), '`', '``'), '`.`', REPLACE(%s, '`', '``'), '`')"
_TABLE_MYSQL = "(COALESCE(%s, DATABASE()), %s)"
_NOT_VISIBLE = {1227: "the PROCESS privilege", 1142: "SELECT on performance_schema", 1044: "access to it"}


class LockWaitsHidden(DatabaseError):
    """The role may not read InnoDB's lock waits: the row-lock watch cannot look (not a failure of the run)."""


@contextlib.contextmanager
def drain_session(conn: MySqlConnection) -> Iterator[None]:
    """Mark ``conn`` as a draining session while the block runs (its named lock, released at the end)."""
    with conn.cursor() as cur:
        cur.execute("SELECT GET_LOCK(CONCAT(%s, CONNECTION_ID()), 0)", (DRAIN_MARK,))
    try:
        yield
    finally:
        if conn.open:
            with contextlib.suppress(pymysql.err.MySQLError), conn.cursor() as cur:
                cur.execute("SELECT RELEASE_LOCK(CONCAT(%s, CONNECTION_ID()))", (DRAIN_MARK,))


def sessions_blocked_by_drains(conn: MySqlConnection, tables: Sequence[str] = ()) -> int:
    """Other sessions waiting for a row of ``tables`` (``table`` or ``database.table``; empty: any
    table) that a draining session holds locked. Raises ``LockWaitsHidden`` when the role may not
    see lock waits."""
    mariadb = is_mariadb(conn)
    statement = (_WAITS_MARIADB if mariadb else _WAITS_MYSQL) + _BY_A_DRAIN
    params: list[str | None] = [DRAIN_MARK, DRAIN_MARK]
    if tables:
        column = "l.lock_table" if mariadb else "(l.OBJECT_SCHEMA, l.OBJECT_NAME)"
        piece = _TABLE_MARIADB if mariadb else _TABLE_MYSQL
        statement += f" AND {column} IN ({', '.join(piece for _ in tables)})"
        for name in tables:
            parts = name.split(".")  # as config.TargetSettings reads a table's name
            params += [parts[0] if len(parts) > 1 else None, parts[-1]]
    try:
        with conn.cursor() as cur:
            cur.execute(statement, tuple(params))
            row = cur.fetchone()
    except pymysql.err.MySQLError as e:
        lacking = _NOT_VISIBLE.get(error_number(e) or 0)
        if lacking is not None:
            raise LockWaitsHidden(f"row-lock waits are hidden from this role (it lacks {lacking})") from None
        raise DatabaseError(f"cannot read the row-lock waits ({describe_db_error(e)})") from None
    return int(row[0]) if row else 0


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
