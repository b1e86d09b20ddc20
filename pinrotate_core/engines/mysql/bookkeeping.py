"""pinrotate's own bookkeeping on MySQL / MariaDB: the ``pinrotate`` database (MySQL has no
schemas inside a database; a database is what PostgreSQL calls a schema) with the tables
``conflicts`` and ``key_checks``, as the ``pinrotate`` schema holds them on PostgreSQL.

One ``pinrotate`` database serves the whole server, while PostgreSQL keeps one ``pinrotate``
schema per database: every row therefore names the database it is about (``database_name``,
the URL's database), so that two applications on one server keep their conflicts and key ids
apart, as they would on PostgreSQL. Statements and their results only; which errors close what
is the caller's (``commands.mysql.bookkeeping``). Every statement runs with a parameter tuple.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Final

from .connect import MySqlConnection, probe
from .operations import OPERATIONS as ops

DATABASE: Final = "pinrotate"
CONFLICTS: Final = "conflicts"
KEY_CHECKS: Final = "key_checks"
# ER_BAD_DB_ERROR, ER_NO_SUCH_TABLE: the database or the table does not exist (yet).
MISSING: Final = frozenset({1049, 1146})
# ER_DBACCESS_DENIED_ERROR, ER_ACCESS_DENIED_ERROR, ER_TABLEACCESS_DENIED_ERROR,
# ER_COLUMNACCESS_DENIED_ERROR, ER_SPECIFIC_ACCESS_DENIED_ERROR: a privilege the role lacks.
DENIED: Final = frozenset({1044, 1045, 1142, 1143, 1227})
LOCK_WAIT_S: Final = 30  # GET_LOCK on the writers' lock: another writer holds it a few statements long

CREATE_DATABASE: Final = f"CREATE DATABASE IF NOT EXISTS {ops.quote(DATABASE)} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
# The whole DDL (docs/reference.md, "The pinrotate.conflicts table" / "The pinrotate.key_checks
# table"; on MySQL each row also names its database). Exact byte comparison (utf8mb4_bin): a
# target or key id differing in case only is another one, as on PostgreSQL.
CREATE_TABLES: Final = {
    CONFLICTS: (f"CREATE TABLE IF NOT EXISTS {ops.relation(DATABASE, CONFLICTS)} ("
                " database_name varchar(64) NOT NULL,"
                " target varchar(255) NOT NULL,"
                " tenant varchar(255) NOT NULL,"
                " conflicts int NOT NULL CHECK (conflicts > 0),"
                " run_id varchar(64) NOT NULL,"
                " recorded_at datetime(6) NOT NULL,"
                " PRIMARY KEY (database_name, target, tenant)"
                ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"),
    KEY_CHECKS: (f"CREATE TABLE IF NOT EXISTS {ops.relation(DATABASE, KEY_CHECKS)} ("
                 " database_name varchar(64) NOT NULL,"
                 " keyring varchar(255) NOT NULL,"
                 " key_id varchar(64) NOT NULL,"
                 " check_value varchar(255) NOT NULL,"
                 " algorithm varchar(64) NOT NULL,"
                 " recorded_at datetime(6) NOT NULL,"
                 " recorded_by varchar(255) NOT NULL,"
                 " PRIMARY KEY (database_name, keyring, key_id)"
                 ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"),
}


def qualified(table: str) -> str:
    return f"{DATABASE}.{table}"


def database_of(conn: MySqlConnection) -> str:
    """The connection's database (the URL's), which bookkeeping rows are about; '' without one."""
    with conn.cursor() as cur:
        cur.execute("SELECT DATABASE()", ())
        row = cur.fetchone()
    return str(row[0]) if row and row[0] is not None else ""


def table_exists(conn: MySqlConnection, table: str) -> bool:
    """Does ``pinrotate.<table>`` exist? Asked of the table itself, not of ``information_schema``
    (which hides a table the role may not read, and would make it look absent): a role without
    the privilege gets the server's refusal (``pymysql`` error, DENIED), never a False."""
    missing = probe(conn, f"SELECT 1 FROM {ops.relation(DATABASE, table)} LIMIT 0", dict.fromkeys(MISSING, True))
    return not missing


def create(conn: MySqlConnection, table: str) -> None:
    """Create the database (unless it exists) and ``pinrotate.<table>``. MySQL commits DDL as it
    runs it; ``IF NOT EXISTS`` makes two hosts creating it at once harmless."""
    with conn.cursor() as cur:
        cur.execute("SHOW DATABASES LIKE %s", (DATABASE,))
        if cur.fetchone() is None:
            cur.execute(CREATE_DATABASE, ())
        cur.execute(CREATE_TABLES[table], ())


@contextmanager
def writing(conn: MySqlConnection, lock: str) -> Iterator[None]:
    """One READ COMMITTED transaction, serialised with pinrotate's other writers of the table
    across processes and hosts by ``GET_LOCK(lock)`` (server-wide); committed at the end, rolled
    back on any error. ``TimeoutError`` when the lock is not had within ``LOCK_WAIT_S``."""
    with conn.cursor() as cur:
        cur.execute("SELECT GET_LOCK(%s, %s)", (lock, LOCK_WAIT_S))
        row = cur.fetchone()
        if not row or row[0] != 1:
            raise TimeoutError(f"the lock {lock} was not had within {LOCK_WAIT_S} s")
        try:
            cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED", ())
            cur.execute("START TRANSACTION", ())
            try:
                yield
            except BaseException:
                conn.rollback()
                raise
            conn.commit()
        finally:
            cur.execute("DO RELEASE_LOCK(%s)", (lock,))


# --- conflicts ------------------------------------------------------------------------------------


def delete_conflicts(conn: MySqlConnection, database: str, target: str, tenant: str | None) -> None:
    statement = f"DELETE FROM {ops.relation(DATABASE, CONFLICTS)} WHERE database_name = %s AND target = %s"
    params: tuple[Any, ...] = (database, target)
    if tenant is not None:
        statement += " AND tenant = %s"
        params += (tenant,)
    with conn.cursor() as cur:
        cur.execute(statement, params)


def upsert_conflicts(conn: MySqlConnection, database: str, target: str, counts: Mapping[str, int], run_id: str, *,
                     add_within_run: bool) -> None:
    """Per tenant: insert ``counts[tenant]``, or keep the larger of it and the stored count;
    ``add_within_run``: a shard of the run that stored the row adds its count instead."""
    rel = ops.relation(DATABASE, CONFLICTS)
    # The SET list is evaluated left to right: conflicts before run_id is overwritten.
    larger = "GREATEST(conflicts, VALUES(conflicts))"
    merged = f"IF(run_id = VALUES(run_id), conflicts + VALUES(conflicts), {larger})" if add_within_run else larger
    statement = (f"INSERT INTO {rel} (database_name, target, tenant, conflicts, run_id, recorded_at)"
                 " VALUES (%s, %s, %s, %s, %s, UTC_TIMESTAMP(6))"
                 f" ON DUPLICATE KEY UPDATE conflicts = {merged}, run_id = VALUES(run_id),"
                 " recorded_at = VALUES(recorded_at)")
    with conn.cursor() as cur:
        for tenant, n in sorted(counts.items()):
            cur.execute(statement, (database, target, tenant, n, run_id))


def sum_conflicts(conn: MySqlConnection, database: str, target: str, tenant: str | None) -> int:
    statement = (f"SELECT COALESCE(SUM(conflicts), 0) FROM {ops.relation(DATABASE, CONFLICTS)}"
                 " WHERE database_name = %s AND target = %s")
    params: tuple[Any, ...] = (database, target)
    if tenant is not None:
        statement += " AND tenant = %s"
        params += (tenant,)
    with conn.cursor() as cur:
        cur.execute(statement, params)
        row = cur.fetchone()
    return int(row[0]) if row else 0


# --- key checks -----------------------------------------------------------------------------------


def insert_key_checks(conn: MySqlConnection, database: str, keyring: str, by: str,
                      checks: Sequence[tuple[str, str, str]]) -> None:
    """``(key_id, check_value, algorithm)`` each, for key ids nothing is recorded for (the caller
    read them under pinrotate's lock on the table): a plain INSERT, so that the role needs only
    SELECT and INSERT (``ON DUPLICATE KEY UPDATE`` asks UPDATE too), and a check value is never
    replaced; a row someone else inserted meanwhile is a duplicate-key error, never overwritten."""
    statement = (f"INSERT INTO {ops.relation(DATABASE, KEY_CHECKS)}"
                 " (database_name, keyring, key_id, check_value, algorithm, recorded_at, recorded_by)"
                 " VALUES (%s, %s, %s, %s, %s, UTC_TIMESTAMP(6), %s)")
    with conn.cursor() as cur:
        for key_id, value, algorithm in checks:
            cur.execute(statement, (database, keyring, key_id, value, algorithm, by))


def read_key_checks(conn: MySqlConnection, database: str, keyring: str,
                    key_ids: Sequence[str]) -> dict[str, tuple[str, str, datetime, str]]:
    """key id -> (check_value, algorithm, recorded_at (UTC), recorded_by) for those recorded."""
    if not key_ids:
        return {}
    marks = ", ".join(["%s"] * len(key_ids))
    with conn.cursor() as cur:
        cur.execute(f"SELECT key_id, check_value, algorithm, recorded_at, recorded_by"
                    f" FROM {ops.relation(DATABASE, KEY_CHECKS)}"
                    f" WHERE database_name = %s AND keyring = %s AND key_id IN ({marks})",
                    (database, keyring, *key_ids))
        return {str(r[0]): (str(r[1]), str(r[2]), r[3].replace(tzinfo=UTC), str(r[4])) for r in cur.fetchall()}
