"""Replication on MySQL / MariaDB as the gate and the throttle see it: each replica's own status
(``SHOW ALL SLAVES STATUS`` on MariaDB, ``SHOW REPLICA STATUS`` on MySQL 8.0.22+, ``SHOW SLAVE
STATUS`` before), waiting for a GTID position, and gh-ost's heartbeat (a row per writer the primary
stamps, read back on a replica: ``throttle/mysql.py`` measures the lag from it). Error numbers only, never a replica's error text (it may quote a
statement and its values)."""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

import pymysql
from pymysql.cursors import DictCursor

from ...errors import DatabaseError
from ..base.checks import ReplicaPosition
from .connect import MySqlConnection, describe_db_error, error_number
from .operations import OPERATIONS as ops

HEARTBEAT_SCHEMA = "pinrotate"
HEARTBEAT_TABLE = "heartbeat"
_PRIVILEGE_HINT = " (the role needs REPLICATION CLIENT, or REPLICA MONITOR / SLAVE MONITOR on MariaDB 10.5+)"


def _is_mariadb(conn: MySqlConnection) -> bool:
    with conn.cursor() as cur:
        cur.execute("SELECT @@version")
        row = cur.fetchone()
    return bool(row and "mariadb" in str(row[0]).lower())


def _status_rows(conn: MySqlConnection) -> list[dict[str, Any]]:
    statements = (["SHOW ALL SLAVES STATUS"] if _is_mariadb(conn)
                  else ["SHOW REPLICA STATUS", "SHOW SLAVE STATUS"])  # MySQL before 8.0.22 knows only the second
    for statement in statements:
        try:
            with conn.cursor(DictCursor) as cur:
                cur.execute(statement)
                return list(cur.fetchall())
        except pymysql.err.MySQLError as e:
            if error_number(e) == 1064 and statement != statements[-1]:
                continue
            hint = _PRIVILEGE_HINT if error_number(e) in (1227, 1142) else ""
            raise DatabaseError(f"cannot read the replication status ({describe_db_error(e)}){hint}") from None
    return []


def _pick(row: dict[str, Any], *names: str) -> Any:
    for name in names:
        if name in row:
            return row[name]
    return None


def position_of(row: dict[str, Any]) -> ReplicaPosition:
    """One row of the replica status, in the names of either server (``Slave_*``/``Master_*`` on
    MariaDB and older MySQL, ``Replica_*``/``Source_*`` on MySQL 8.0.22+)."""
    io = str(_pick(row, "Replica_IO_Running", "Slave_IO_Running") or "")
    sql_thread = str(_pick(row, "Replica_SQL_Running", "Slave_SQL_Running") or "")
    lag = _pick(row, "Seconds_Behind_Source", "Seconds_Behind_Master")
    host = _pick(row, "Source_Host", "Master_Host")
    port = _pick(row, "Source_Port", "Master_Port")
    channel = _pick(row, "Connection_name", "Channel_Name", "Channel_name")
    name = f"{channel + '@' if channel else ''}{host}:{port}"
    running = io == "Yes" and sql_thread == "Yes"
    problem = None
    if not running:
        errors = [f"{k} {row[k]}" for k in ("Last_IO_Errno", "Last_SQL_Errno") if row.get(k)]
        problem = (f"replication not running (IO {io or '?'}, SQL {sql_thread or '?'}"
                   f"{'; ' + ', '.join(errors) if errors else ''})")
    position = _pick(row, "Gtid_Slave_Pos", "Executed_Gtid_Set", "Gtid_IO_Pos")
    return ReplicaPosition(name, None if lag is None or not running else float(lag),
                           None if position is None else str(position).replace("\n", ""), running, problem)


def replica_status(conn: MySqlConnection) -> list[ReplicaPosition]:
    """The sources this server replicates from, as it sees them (empty on a primary)."""
    return [position_of(row) for row in _status_rows(conn)]


def server_id(conn: MySqlConnection) -> int:
    """``@@server_id``: how a primary and its replicas tell each other apart."""
    with conn.cursor() as cur:
        cur.execute("SELECT @@server_id")
        row = cur.fetchone()
    return int(row[0]) if row else 0


def source_server_ids(conn: MySqlConnection) -> set[int]:
    """The ``@@server_id`` of each source this server replicates from (empty on a primary)."""
    ids = (_pick(row, "Source_Server_Id", "Master_Server_Id") for row in _status_rows(conn))
    return {int(i) for i in ids if i is not None}


def binlog_readers(conn: MySqlConnection) -> int:
    """Sessions reading this server's binary log (``Binlog Dump`` threads: replicas, and any other
    reader such as a CDC tool); needs ``PROCESS`` to see other users' sessions. The driver's error
    as it comes."""
    with conn.cursor() as cur:
        cur.execute("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%%'", ())
        row = cur.fetchone()
    return int(row[0]) if row else 0


def attached_replicas(conn: MySqlConnection) -> set[int] | None:
    """The ``@@server_id`` of each replica registered with this primary (``SHOW SLAVE HOSTS``,
    ``SHOW REPLICAS`` on MySQL 8.0.22+); None when the server will not say."""
    for statement in ("SHOW SLAVE HOSTS", "SHOW REPLICAS"):
        try:
            with conn.cursor(DictCursor) as cur:
                cur.execute(statement)
                ids = (_pick(row, "Server_id", "Server_Id") for row in cur.fetchall())
                return {int(i) for i in ids if i is not None}
        except pymysql.err.MySQLError:
            continue
    return None


def wait_for_position(replica: MySqlConnection, position: str, timeout: float) -> bool:
    """True once ``replica`` has applied the primary's GTID ``position`` (``MASTER_GTID_WAIT`` on
    MariaDB, ``WAIT_FOR_EXECUTED_GTID_SET`` on MySQL), False after ``timeout`` seconds."""
    if not position:
        return True
    wait = ("SELECT MASTER_GTID_WAIT(%s, %s)" if _is_mariadb(replica)
            else "SELECT WAIT_FOR_EXECUTED_GTID_SET(%s, %s)")
    try:
        with replica.cursor() as cur:
            cur.execute(wait, (position, max(timeout, 0.001)))
            row = cur.fetchone()
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"cannot wait for the replica's GTID position ({describe_db_error(e)})") from None
    return row is not None and row[0] is not None and int(row[0]) == 0


def _heartbeat(schema: str, table: str) -> str:
    return ops.relation(schema, table)


class HeartbeatUnavailable(DatabaseError):
    """The heartbeat table is absent, or the role may not write it: the lag is then read from each
    replica's status alone (the throttle says so once)."""


def create_heartbeat_sql(schema: str = HEARTBEAT_SCHEMA, table: str = HEARTBEAT_TABLE) -> str:
    """The heartbeat table's DDL (for its owner to run, with an empty parameter tuple): one row per
    writer (a run's throttle in one process), its latest stamp."""
    return (f"CREATE TABLE IF NOT EXISTS {_heartbeat(schema, table)} (writer VARCHAR(64) CHARACTER SET ascii"
            " PRIMARY KEY, stamped_at DATETIME(6) NOT NULL) ENGINE = InnoDB")


_ABSENT = (1146, 1049)  # no such table, no such database
_REFUSED = (1142, 1143, 1044, 1045)


def write_heartbeat(primary: MySqlConnection, writer: str, stamp: datetime,
                    schema: str = HEARTBEAT_SCHEMA, table: str = HEARTBEAT_TABLE) -> None:
    """Stamp ``writer``'s row on the primary (one autocommit statement, binary-logged like the
    batches). ``HeartbeatUnavailable`` when the table is absent or the role may not write it."""
    try:
        with primary.cursor() as cur:
            cur.execute(f"INSERT INTO {_heartbeat(schema, table)} (writer, stamped_at) VALUES (%s, %s)"
                        " ON DUPLICATE KEY UPDATE stamped_at = VALUES(stamped_at)", (writer, stamp))
    except pymysql.err.MySQLError as e:
        number = error_number(e)
        relation = f"{schema}.{table}"
        if number in _ABSENT:
            raise HeartbeatUnavailable(f"no table {relation} (its DDL is in what `grants` prints)") from None
        if number in _REFUSED:
            raise HeartbeatUnavailable(f"the role may not write {relation} ({describe_db_error(e)})") from None
        raise DatabaseError(f"cannot write the replication heartbeat ({describe_db_error(e)})") from None


def read_heartbeat(replica: MySqlConnection, writer: str, schema: str = HEARTBEAT_SCHEMA,
                   table: str = HEARTBEAT_TABLE) -> datetime | None:
    """The last stamp of ``writer`` the replica has applied (None: none yet).
    ``HeartbeatUnavailable`` when the replica has no such table (a replication filter that leaves
    the ``pinrotate`` database out would keep every stamp away, and the lag would only grow)."""
    try:
        with replica.cursor() as cur:
            cur.execute(f"SELECT stamped_at FROM {_heartbeat(schema, table)} WHERE writer = %s", (writer,))
            row = cur.fetchone()
    except pymysql.err.MySQLError as e:
        if error_number(e) in _ABSENT:
            raise HeartbeatUnavailable(f"the replica has no table {schema}.{table} (does it replicate the "
                                       f"{schema} database?)") from None
        raise DatabaseError(f"cannot read the replication heartbeat ({describe_db_error(e)})") from None
    if row is None or row[0] is None:
        return None
    stamp = row[0]
    assert isinstance(stamp, datetime)
    return stamp


def remove_heartbeat(primary: MySqlConnection, writer: str, schema: str = HEARTBEAT_SCHEMA,
                     table: str = HEARTBEAT_TABLE) -> None:
    """The writer's row, gone at the end of its run (a failure here is not the run's)."""
    with contextlib.suppress(pymysql.err.MySQLError), primary.cursor() as cur:
        cur.execute(f"DELETE FROM {_heartbeat(schema, table)} WHERE writer = %s", (writer,))
