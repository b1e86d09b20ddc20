"""The MySQL room's compare-and-swap write guard, on the real MariaDB: rows an application holds
are skipped, never waited on; an application's edit is never overwritten; columns the server
maintains itself (ON UPDATE CURRENT_TIMESTAMP) keep their values; what was stored is read back."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pymysql
import pytest

from pinrotate_core.engines.mysql.catalog import CATALOG
from pinrotate_core.engines.mysql.connect import MySqlConnection
from pinrotate_core.engines.mysql.guard import CasRow, MySqlCasGuard, batch_transaction, lock_wait_seconds
from tests.mariadb_server import MariaDbServer

OLD_TIME = dt.datetime(2001, 2, 3, 4, 5, 6)


@pytest.fixture
def app_conn(mariadb: MariaDbServer, mysql_database: str) -> Iterator[MySqlConnection]:
    """The application's own session (not autocommit: it holds what it locks until it ends)."""
    conn = mariadb.connect(mysql_database, autocommit=False)
    yield conn
    conn.rollback()
    conn.close()


def run(conn: MySqlConnection, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with conn.cursor() as cur:
        cur.execute(statement, params or None)
        return list(cur.fetchall())


@pytest.fixture
def persons(my_conn: MySqlConnection) -> MySqlCasGuard:
    """Five rows on key version 1, ``update_time`` set long ago (the server would rewrite it)."""
    run(my_conn, "CREATE TABLE persons (id BIGINT PRIMARY KEY, name_cipher VARCHAR(200), blob_cipher VARBINARY(64),"
                 " key_version INT NOT NULL, deleted TINYINT NOT NULL DEFAULT 0,"
                 " update_time DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP)")
    for i in range(1, 6):
        run(my_conn, "INSERT INTO persons (id, name_cipher, blob_cipher, key_version, update_time)"
                     " VALUES (%s, %s, %s, 1, %s)", (i, f"old-{i}", bytes([i]) * 4, OLD_TIME))
    table = CATALOG.read_table(my_conn, None, "persons")
    assert table is not None
    return MySqlCasGuard(table, "id", ["name_cipher", "blob_cipher"], key_version="key_version",
                         stale_where="t.`key_version` < 2 AND t.`deleted` = 0")


def rows_for(batch: list[tuple[object, ...]]) -> list[CasRow]:
    return [CasRow(r[0], (r[1], r[2]), (f"new-{r[0]}", b"\xff" + bytes(r[2]))) for r in batch]  # type: ignore[arg-type]


def test_a_batch_is_read_in_keyset_order_after_the_last_id(my_conn: MySqlConnection, persons: MySqlCasGuard) -> None:
    assert [r[0] for r in persons.read_batch(my_conn, None, None, 2)] == [1, 2]
    assert [r[0] for r in persons.read_batch(my_conn, 2, None, 10)] == [3, 4, 5]
    assert [r[0] for r in persons.read_batch(my_conn, 1, 3, 10)] == [2, 3]
    assert persons.read_batch(my_conn, None, None, 1)[0][1:] == ("old-1", b"\x01" * 4)


def test_a_write_stores_new_values_and_key_version_in_one_transaction(my_conn: MySqlConnection,
                                                                      persons: MySqlCasGuard) -> None:
    batch = persons.read_batch(my_conn, None, None, 10)
    with batch_transaction(my_conn, 0.05):
        outcome = persons.write(my_conn, rows_for(batch), key_version=2)
    assert outcome.written == [1, 2, 3, 4, 5] and not (outcome.changed or outcome.skipped or outcome.mismatched)
    assert outcome.stored[3] == ("new-3", b"\xff" + b"\x03" * 4, 2)
    assert run(my_conn, "SELECT name_cipher, key_version FROM persons WHERE id = 3") == [("new-3", 2)]
    assert persons.read_batch(my_conn, None, None, 10) == []  # no longer stale


def test_on_update_current_timestamp_columns_keep_their_values(my_conn: MySqlConnection,
                                                                persons: MySqlCasGuard) -> None:
    assert persons.kept == ["update_time"]
    # Without setting it to itself, the server rewrites it: the test would prove nothing otherwise.
    run(my_conn, "UPDATE persons SET name_cipher = 'plain-update' WHERE id = 5")
    assert run(my_conn, "SELECT update_time FROM persons WHERE id = 5")[0][0] != OLD_TIME
    batch = persons.read_batch(my_conn, None, 4, 10)
    with batch_transaction(my_conn, 0.05):
        outcome = persons.write(my_conn, rows_for(batch), key_version=2)
    assert outcome.written == [1, 2, 3, 4]
    assert {r[0] for r in run(my_conn, "SELECT update_time FROM persons WHERE id <= 4")} == {OLD_TIME}


def test_a_row_an_application_holds_locked_is_skipped_not_waited_on(my_conn: MySqlConnection, app_conn: MySqlConnection,
                                                                     persons: MySqlCasGuard) -> None:
    batch = persons.read_batch(my_conn, None, None, 10)
    run(app_conn, "SELECT id FROM persons WHERE id = 2 FOR UPDATE")  # the application's transaction holds row 2
    # A wait would end in a lock wait timeout error (1 s) instead of an outcome.
    with batch_transaction(my_conn, 1):
        outcome = persons.write(my_conn, rows_for(batch), key_version=2)
    assert outcome.skipped == [2] and outcome.written == [1, 3, 4, 5]
    app_conn.rollback()
    assert run(my_conn, "SELECT name_cipher, key_version FROM persons WHERE id = 2") == [("old-2", 1)]


def test_an_application_edit_between_read_and_write_is_never_overwritten(
        my_conn: MySqlConnection, app_conn: MySqlConnection, persons: MySqlCasGuard) -> None:
    batch = persons.read_batch(my_conn, None, None, 10)
    run(app_conn, "UPDATE persons SET name_cipher = 'edited-by-app' WHERE id = 2")
    run(app_conn, "UPDATE persons SET name_cipher = 'OLD-3' WHERE id = 3")  # case only: still an edit
    run(app_conn, "UPDATE persons SET name_cipher = 'old-4 ' WHERE id = 4")  # a trailing blank: still an edit
    run(app_conn, "UPDATE persons SET deleted = 1 WHERE id = 5")  # out of scope now
    app_conn.commit()
    with batch_transaction(my_conn, 0.05):
        outcome = persons.write(my_conn, rows_for(batch), key_version=2)
    assert outcome.written == [1] and outcome.changed == [2, 3, 4, 5]
    assert run(my_conn, "SELECT id, name_cipher, key_version FROM persons WHERE id > 1 ORDER BY id") == [
        (2, "edited-by-app", 1), (3, "OLD-3", 1), (4, "old-4 ", 1), (5, "old-5", 1)]


def test_the_update_itself_compares_exact_bytes(my_conn: MySqlConnection, persons: MySqlCasGuard) -> None:
    """The statement's own guard (behind the check under lock) folds no case and no trailing blank."""
    params: list[object] = [1, "OLD-1", "x", b"\x01" * 4, b"y", 2, "old-2 ", "x", b"\x02" * 4, b"y",
                            3, "old-3", "x", b"\x03" * 4, b"y", 2]
    with batch_transaction(my_conn, 0.05):
        run(my_conn, persons.update_statement(3), tuple(params))
    assert run(my_conn, "SELECT id, name_cipher FROM persons WHERE id <= 3 ORDER BY id") == [
        (1, "old-1"), (2, "old-2"), (3, "x")]


def test_what_a_trigger_changed_is_read_back_as_mismatched(my_conn: MySqlConnection, persons: MySqlCasGuard) -> None:
    run(my_conn, "CREATE TRIGGER persons_upd BEFORE UPDATE ON persons FOR EACH ROW"
                 " SET NEW.name_cipher = IF(NEW.id = 3, 'trigger-made', NEW.name_cipher)")
    batch = persons.read_batch(my_conn, None, None, 10)
    with pytest.raises(RuntimeError), batch_transaction(my_conn, 0.05):
        outcome = persons.write(my_conn, rows_for(batch), key_version=2)
        assert outcome.mismatched == [3] and outcome.stored[3][0] == "trigger-made"
        raise RuntimeError("verification failed: roll the batch back")
    assert run(my_conn, "SELECT count(*) FROM persons WHERE key_version = 1") == [(5,)]


def test_the_lock_wait_is_whole_seconds_and_reset_after_the_batch(my_conn: MySqlConnection,
                                                                  persons: MySqlCasGuard) -> None:
    assert (lock_wait_seconds(0.05), lock_wait_seconds(1.0), lock_wait_seconds(2.5)) == (1, 1, 3)
    default = run(my_conn, "SELECT @@GLOBAL.innodb_lock_wait_timeout")[0][0]
    with batch_transaction(my_conn, 3):
        assert run(my_conn, "SELECT @@SESSION.innodb_lock_wait_timeout") == [(3,)]
    assert run(my_conn, "SELECT @@SESSION.innodb_lock_wait_timeout") == [(default,)]
    with pytest.raises(pymysql.err.OperationalError, match="1054"), batch_transaction(my_conn, 3):
        run(my_conn, "UPDATE persons SET name_cipher = 'half' WHERE id = 1")
        run(my_conn, "SELECT no_such_column FROM persons")
    assert run(my_conn, "SELECT name_cipher FROM persons WHERE id = 1") == [("old-1",)]
    assert run(my_conn, "SELECT @@SESSION.innodb_lock_wait_timeout") == [(default,)]


def session_limits(conn: MySqlConnection) -> tuple[object, ...]:
    return run(conn, "SELECT @@session.innodb_lock_wait_timeout, @@session.max_statement_time,"
                     " @@session.idle_transaction_timeout")[0]


def test_a_batch_sets_its_statement_and_idle_timeouts_and_leaves_the_session_as_it_was(
        my_conn: MySqlConnection, persons: MySqlCasGuard) -> None:
    before = session_limits(my_conn)
    with batch_transaction(my_conn, 0.05, statement_timeout=30, idle_timeout=60):
        assert session_limits(my_conn) == (1, 30.0, 60)
    assert session_limits(my_conn) == before


def test_a_batch_statement_past_statement_timeout_is_stopped_by_the_server_and_the_batch_rolls_back(
        my_conn: MySqlConnection, persons: MySqlCasGuard) -> None:
    # MariaDB's max_statement_time: the server interrupts the statement (error 1969), whatever it is.
    with pytest.raises(pymysql.err.OperationalError, match="1969"), \
            batch_transaction(my_conn, 1, statement_timeout=0.5):
        run(my_conn, "UPDATE persons SET name_cipher = 'x' WHERE id = 1")
        run(my_conn, "SELECT SLEEP(5) FROM persons WHERE id = 1 FOR UPDATE")
    assert run(my_conn, "SELECT name_cipher FROM persons WHERE id = 1") == [("old-1",)]


def test_a_batch_transaction_left_idle_past_its_timeout_is_ended_by_the_server_and_writes_nothing(
        mariadb: MariaDbServer, mysql_database: str, persons: MySqlCasGuard) -> None:
    import time

    conn = mariadb.connect(mysql_database)
    try:
        with pytest.raises(pymysql.err.OperationalError), batch_transaction(conn, 1, idle_timeout=1):
            run(conn, "UPDATE persons SET name_cipher = 'x' WHERE id = 2")
            time.sleep(2.5)  # a client stuck between two statements of its batch
            run(conn, "SELECT 1")  # the server has ended the session: its transaction rolled back
    finally:
        conn.close()
    with mariadb.connect(mysql_database) as check, check.cursor() as cur:
        cur.execute("SELECT name_cipher FROM persons WHERE id = 2")
        assert cur.fetchall() == (("old-2",),)
