"""What the retire gate asks of MySQL / MariaDB (``base.checks.GateChecks``): one consistent
read-only snapshot, the columns the sweep must read on the whole server, transactions in flight
(``INNODB_TRX``) and prepared (``XA RECOVER``), durability settings and the primary's position.
Reads only; every failure to read is a DatabaseError naming what was missing (fail closed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pymysql

from ...errors import DatabaseError
from ..base.checks import CandidateColumn, Durability, OpenTransaction, ReplicaPosition
from .bookkeeping import DATABASE as BOOKKEEPING_DATABASE
from .connect import LOCK_WAIT_TIMEOUT, TABLE_LOCK_WAIT_S, MySqlConnection, describe_db_error, error_number, probe
from .operations import OPERATIONS as ops
from .replication import replica_status

# The server's own schemas, and pinrotate's bookkeeping (counts, names and check values: never a
# ciphertext), as PostgreSQL's sweep skips the pinrotate schema.
SYSTEM_SCHEMAS = ("mysql", "sys", "information_schema", "performance_schema", BOOKKEEPING_DATABASE)
TEXT_TYPES = ("char", "varchar", "tinytext", "text", "mediumtext", "longtext", "json")
BINARY_TYPES = ("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob")
# Storage engines whose rows a consistent snapshot covers (and that roll back).
TRANSACTIONAL_ENGINES = ("innodb",)
_ACCESS_DENIED = frozenset({1142, 1143, 1227})
_NO_SUCH_TABLE = 1146
_TABLE_DEF_CHANGED = 1412
# How long a read of the gate (or of an inventory) waits for a table's metadata lock held by DDL
# (``LOCK TABLES ... WRITE``, an ALTER): the server's default is a day or a year. Past it the table
# is UNREADABLE, named, as PostgreSQL's sweep gives up after its lock_timeout.
LOCK_WAIT_S = 5
INNODB_TRX_CACHE_S = 0.1  # information_schema.INNODB_TRX is refreshed at most this often


def _rows(conn: MySqlConnection, what: str, statement: str,
          params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    try:
        with conn.cursor() as cur:
            cur.execute(statement, params or None)  # no parameters: a % is a plain character
            return list(cur.fetchall())
    except pymysql.err.MySQLError as e:
        hint = " (the role needs the PROCESS privilege)" if error_number(e) == 1227 and "INNODB_TRX" in statement else ""
        raise DatabaseError(f"cannot read {what} ({describe_db_error(e)}){hint}") from None


def changed_since_snapshot(e: BaseException) -> str | None:
    """Why a read inside a consistent snapshot failed when InnoDB's snapshot did not hold DDL back
    (it does not: only the tables a transaction has read are held): None for any other failure."""
    number = error_number(e)
    if number == _TABLE_DEF_CHANGED:
        return "rewritten after the snapshot (truncated, altered or replaced: error 1412)"
    if number == _NO_SUCH_TABLE:
        return "dropped or renamed after the snapshot (error 1146)"
    return None


class MySqlGateChecks:
    @contextlib.contextmanager
    def snapshot(self, conn: MySqlConnection) -> Iterator[None]:
        """Every read inside sees one moment of every InnoDB table of the server; nothing can be
        written through it. Rolled back at the end (there is nothing to commit)."""
        with conn.cursor() as cur:
            cur.execute(f"SET SESSION lock_wait_timeout = {int(LOCK_WAIT_S)}")
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")  # the next transaction only
            cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
        try:
            yield
        finally:
            conn.rollback()
            with conn.cursor() as cur:
                cur.execute(f"SET SESSION lock_wait_timeout = {TABLE_LOCK_WAIT_S}")  # as every connection has it

    def candidate_columns(self, conn: MySqlConnection) -> list[CandidateColumn]:
        """Every text, JSON or binary column of every base table the server shows this role,
        system schemas aside, each marked readable or not (an ``EXPLAIN`` of its SELECT) and
        transactional or not (a MyISAM / Aria / MEMORY table is outside any snapshot).

        A table on which the role holds no privilege at all is not shown by
        ``information_schema``: ``sees_every_table`` tells whether that can happen.
        """
        rows = self._catalog(conn)
        found: list[CandidateColumn] = []
        for schema, table, column, type_name, engine in rows:
            readable = self._readable(conn, str(schema), str(table), str(column))
            found.append(CandidateColumn(str(schema), str(table), str(column), str(type_name),
                                         binary=str(type_name) in BINARY_TYPES, readable=readable,
                                         transactional=str(engine or "") in TRANSACTIONAL_ENGINES))
        return found

    @staticmethod
    def _catalog(conn: MySqlConnection) -> list[tuple[object, ...]]:
        kinds = ", ".join(f"'{t}'" for t in (*TEXT_TYPES, *BINARY_TYPES))
        system = ", ".join(f"'{s}'" for s in SYSTEM_SCHEMAS)
        return _rows(conn, "the catalog of the sweep",
                     "SELECT c.TABLE_SCHEMA, c.TABLE_NAME, c.COLUMN_NAME, LOWER(c.DATA_TYPE), LOWER(t.ENGINE)"
                     " FROM information_schema.COLUMNS c JOIN information_schema.TABLES t"
                     " ON t.TABLE_SCHEMA = c.TABLE_SCHEMA AND t.TABLE_NAME = c.TABLE_NAME"
                     f" WHERE t.TABLE_TYPE = 'BASE TABLE' AND c.TABLE_SCHEMA NOT IN ({system})"
                     f" AND LOWER(c.DATA_TYPE) IN ({kinds}) AND c.EXTRA NOT LIKE '%GENERATED%'"
                     " ORDER BY c.TABLE_SCHEMA, c.TABLE_NAME, c.ORDINAL_POSITION")

    def candidate_tables(self, conn: MySqlConnection) -> set[tuple[str, str]]:
        """(schema, table) of every table ``candidate_columns`` would list now, without its checks.
        Read right before a snapshot: the catalog is not in the snapshot (``information_schema``
        shows the tables as they are when it is read), so a table dropped or renamed after the
        snapshot began is missing from ``candidate_columns`` and only this list tells it was there."""
        return {(str(schema), str(table)) for schema, table, *_ in self._catalog(conn)}

    @staticmethod
    def _readable(conn: MySqlConnection, schema: str, table: str, column: str) -> bool:
        # Dropped since the catalog was read (_NO_SUCH_TABLE), or held by DDL past LOCK_WAIT_S: readable
        # as far as privileges go; the read itself names it (dropped after the snapshot, or locked).
        refusals = {**dict.fromkeys(_ACCESS_DENIED, False), _NO_SUCH_TABLE: True, LOCK_WAIT_TIMEOUT: True}
        try:
            answer = probe(conn, f"EXPLAIN SELECT {ops.quote(column)} FROM {ops.relation(schema, table)} LIMIT 0",
                           refusals)
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"cannot check the privileges on {schema}.{table} ({describe_db_error(e)})") from None
        return True if answer is None else answer

    def sees_every_table(self, conn: MySqlConnection) -> bool:
        """True when the role holds a global SELECT (``GRANT SELECT ON *.*``), so that
        ``information_schema`` hides no table from it. Granted through a role, it is not seen
        here: the answer is then False (fail closed)."""
        rows = _rows(conn, "the role's global privileges",
                     "SELECT COUNT(*) FROM information_schema.USER_PRIVILEGES WHERE PRIVILEGE_TYPE = 'SELECT'"
                     " AND GRANTEE = CONCAT('''', SUBSTRING_INDEX(CURRENT_USER(), '@', 1), '''@''',"
                     " SUBSTRING_INDEX(CURRENT_USER(), '@', -1), '''')")
        return bool(rows and int(str(rows[0][0])) > 0)

    def in_flight(self, conn: MySqlConnection) -> list[OpenTransaction]:
        """InnoDB transactions of other sessions that can write: neither read-only nor a
        non-locking autocommit SELECT. Needs the PROCESS privilege. A transaction that has not
        yet touched an InnoDB table is not there yet (InnoDB starts it at its first access).

        InnoDB serves this view from a cache refreshed at most every ``INNODB_TRX_CACHE_S``: what
        it shows may be that old. A mark of what was in flight at a moment is read that long
        after the moment; a transaction that ended may still be listed that long."""
        rows = _rows(conn, "the transactions in flight (information_schema.INNODB_TRX)",
                     "SELECT x.trx_mysql_thread_id, x.trx_id, p.USER, x.trx_state,"
                     " TIMESTAMPDIFF(MICROSECOND, x.trx_started, NOW(6)) / 1e6"
                     " FROM information_schema.INNODB_TRX x"
                     " LEFT JOIN information_schema.PROCESSLIST p ON p.ID = x.trx_mysql_thread_id"
                     " WHERE x.trx_mysql_thread_id <> CONNECTION_ID()"
                     " AND NOT x.trx_is_read_only AND NOT x.trx_autocommit_non_locking"
                     " ORDER BY x.trx_started, x.trx_mysql_thread_id")
        return [OpenTransaction(int(str(thread)), str(trx), None if user is None else str(user),
                                None if state is None else str(state), float(str(open_s or 0)))
                for thread, trx, user, state, open_s in rows]

    def prepared(self, conn: MySqlConnection) -> list[str]:
        """XA transactions prepared and not yet committed or rolled back, server-wide (XA has no
        database): ``formatID:gtrid:bqual`` in hex. MySQL 8 asks XA_RECOVER_ADMIN for it."""
        rows = _rows(conn, "the prepared XA transactions (XA RECOVER)", "XA RECOVER")
        out = []
        for format_id, gtrid_length, bqual_length, data in rows:
            raw = data if isinstance(data, bytes) else str(data).encode()
            g, b = int(str(gtrid_length)), int(str(bqual_length))
            out.append(f"{format_id}:{raw[:g].hex()}:{raw[g:g + b].hex()}")
        return out

    def durability(self, conn: MySqlConnection) -> Durability:
        """Durable when every commit is flushed before it returns: ``innodb_flush_log_at_trx_commit
        = 1`` and, with a binary log, ``sync_binlog = 1``. Otherwise commits reach the disk within
        ``innodb_flush_log_at_timeout`` seconds (``flush_wait_s``): a gate may wait that long
        after its reads instead."""
        rows = _rows(conn, "the durability settings",
                     "SELECT @@innodb_flush_log_at_trx_commit, @@sync_binlog, @@log_bin, @@innodb_flush_log_at_timeout")
        flush, sync_binlog, log_bin, timeout = (int(str(v)) for v in rows[0])
        reasons = []
        if flush != 1:
            reasons.append(f"innodb_flush_log_at_trx_commit = {flush}: a commit is flushed within "
                           f"innodb_flush_log_at_timeout = {timeout}s, not at once")
        if log_bin and sync_binlog != 1:
            reasons.append(f"sync_binlog = {sync_binlog}: the binary log is not flushed at every commit")
        settings = {"innodb_flush_log_at_trx_commit": flush, "sync_binlog": sync_binlog, "log_bin": bool(log_bin),
                    "flush_wait_s": 0 if not reasons else max(timeout, 1)}
        return Durability(not reasons, settings, tuple(reasons))

    def primary_position(self, conn: MySqlConnection) -> str | None:
        """The GTID position of everything committed here (None without a binary log):
        ``@@gtid_binlog_pos`` on MariaDB (``domain-server-seqno``), ``@@gtid_executed`` on MySQL (UUID sets)."""
        rows = _rows(conn, "the binary log settings", "SELECT @@log_bin, @@version")
        if not int(str(rows[0][0])):
            return None
        variable = "@@gtid_binlog_pos" if "mariadb" in str(rows[0][1]).lower() else "@@gtid_executed"
        position = _rows(conn, "the GTID position", f"SELECT {variable}")
        return str(position[0][0] or "")

    def replica_positions(self, conn: MySqlConnection) -> list[ReplicaPosition]:
        return replica_status(conn)


GATE_CHECKS = MySqlGateChecks()
