"""The MySQL room's write guard by the way it sends its rows (issue 32, the drain's speed): a row
source per server flavour, values inlined as hex, one count instead of a row per locked row and
per stored row. On the real MariaDB: every form it parses writes exactly what the slower,
bound-parameter statements wrote; the slower path (back to the savepoint, compared here) is still
taken whenever a count says something is in the way."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pymysql
import pytest

from pinrotate_core.engines.mysql.catalog import CATALOG
from pinrotate_core.engines.mysql.connect import MySqlConnection, ServerInfo, server_info
from pinrotate_core.engines.mysql.guard import (
    ROW_FORMS,
    CasRow,
    MySqlCasGuard,
    batch_transaction,
    row_form,
    row_source,
)
from tests.mariadb_server import MariaDbServer

OLD_TIME = dt.datetime(2001, 2, 3, 4, 5, 6)
# Text a collation folds or a careless escape breaks: quotes, a backslash, %, a NUL, 2-, 3- and 4-byte UTF-8.
AWKWARD = ["it's \\ 100% \x00 done", "é ü ß", "€ 中文", "🙂 emoji", "", "trailing  "]


def run(conn: MySqlConnection, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with conn.cursor() as cur:
        cur.execute(statement, params or None)
        return list(cur.fetchall())


@pytest.fixture
def app_conn(mariadb: MariaDbServer, mysql_database: str) -> Iterator[MySqlConnection]:
    conn = mariadb.connect(mysql_database, autocommit=False)
    yield conn
    conn.rollback()
    conn.close()


def test_the_row_source_is_picked_by_server_flavour_and_version() -> None:
    assert row_form(ServerInfo("mariadb", (10, 11, 6), "10.11.6-MariaDB")) == "values"
    assert row_form(ServerInfo("mariadb", (10, 6, 0), "10.6.0-MariaDB")) == "values"
    assert row_form(ServerInfo("mysql", (8, 0, 19), "8.0.19")) == "values_row"
    assert row_form(ServerInfo("mysql", (8, 4, 3), "8.4.3")) == "values_row"
    assert row_form(ServerInfo("mysql", (8, 0, 18), "8.0.18")) == "union"  # no VALUES statement before 8.0.19
    names = ["pinrotate_id", "o0", "n0"]
    head = "SELECT NULL AS pinrotate_id, NULL AS o0, NULL AS n0 FROM DUAL WHERE FALSE UNION ALL "
    rows = ["1, X'61', X'62'", "2, NULL, X''"]
    assert row_source("values", names, rows) == head + "VALUES (1, X'61', X'62'), (2, NULL, X'')"
    assert row_source("values_row", names, rows) == head + "VALUES ROW(1, X'61', X'62'), ROW(2, NULL, X'')"
    assert row_source("union", names, rows) == head + "SELECT 1, X'61', X'62' UNION ALL SELECT 2, NULL, X''"
    with pytest.raises(ValueError, match="unknown row source"):
        row_source("tvc", names, rows)
    with pytest.raises(ValueError, match="at least one row"):
        row_source("values", names, [])


def test_the_guard_asks_the_server_once_when_not_told(my_conn: MySqlConnection) -> None:
    run(my_conn, "CREATE TABLE p (id INT PRIMARY KEY, c VARCHAR(20))")
    run(my_conn, "INSERT INTO p VALUES (1, 'a')")
    table = CATALOG.read_table(my_conn, None, "p")
    assert table is not None
    guard = MySqlCasGuard(table, "id", ["c"])
    assert guard.form is None
    with batch_transaction(my_conn, 1):
        assert guard.write(my_conn, [CasRow(1, ("a",), ("b",))]).written == [1]
    assert guard.form == row_form(server_info(my_conn)) == "values"  # MariaDB here
    assert MySqlCasGuard(table, "id", ["c"], server=server_info(my_conn)).form == "values"


@pytest.mark.parametrize("form", [f for f in ROW_FORMS if f != "values_row"])  # values_row: MySQL 8.0.19+ only
def test_every_form_mariadb_parses_writes_exact_values(my_conn: MySqlConnection, form: str) -> None:
    """Text in a latin1 column and a utf8mb4 one, bytes, NULL: stored exactly, read back in the
    server, the ON UPDATE column kept; the same through the bound-parameter statement."""
    run(my_conn, "CREATE TABLE p (id VARCHAR(40) CHARACTER SET utf8mb4 PRIMARY KEY,"
                 " u TEXT CHARACTER SET utf8mb4, l VARCHAR(100) CHARACTER SET latin1, b VARBINARY(64), kv INT NOT NULL,"
                 " upd DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP)")
    latin = ["it's \\ 100% done", "é ü ß", "", "trailing  ", None, "x"]
    for i, (u, lt) in enumerate(zip(AWKWARD, latin, strict=True)):
        run(my_conn, "INSERT INTO p VALUES (%s, %s, %s, %s, 1, %s)", (f"id-{i}'%", u, lt, bytes([i, 0, 39, 92]), OLD_TIME))
    table = CATALOG.read_table(my_conn, None, "p")
    assert table is not None
    guard = MySqlCasGuard(table, "id", ["u", "l", "b"], key_version="kv", stale_where="t.`kv` < 2", form=form)
    batch = guard.read_batch(my_conn, None, None, 100)
    assert len(batch) == 6
    new = {r[0]: (f"{r[2]} → {r[1]}", (r[2] or "") + "ä", b"\x00'\\" + bytes(r[3])) for r in batch}
    with batch_transaction(my_conn, 1):
        outcome = guard.write(my_conn, [CasRow(r[0], tuple(r[1:]), new[r[0]]) for r in batch], key_version=2)
    assert sorted(outcome.written) == sorted(new) and not (outcome.changed or outcome.skipped or outcome.mismatched)
    assert {k: v[:3] for k, v in outcome.stored.items()} == new
    stored = {r[0]: tuple(r[1:]) for r in run(my_conn, "SELECT id, u, l, b, kv, upd FROM p")}
    assert stored == {k: (*v, 2, OLD_TIME) for k, v in new.items()}


def test_a_percent_in_names_is_sent_as_one(my_conn: MySqlConnection, app_conn: MySqlConnection) -> None:
    """The statements run without parameters have their fixed text formatted once (``%%`` -> ``%``),
    on the quick path and the slower one alike."""
    run(my_conn, "CREATE TABLE `p%s` (`i%d` INT PRIMARY KEY, `c%%` VARCHAR(20), `k%` INT NOT NULL,"
                 " `u%s` DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP)")
    for i in range(1, 4):
        run(my_conn, "INSERT INTO `p%%s` VALUES (%s, %s, 1, %s)", (i, f"v{i}", OLD_TIME))
    table = CATALOG.read_table(my_conn, None, "p%s")
    assert table is not None
    guard = MySqlCasGuard(table, "i%d", ["c%%"], key_version="k%", stale_where="t.`k%%` < 2")
    batch = guard.read_batch(my_conn, None, None, 10)
    with batch_transaction(my_conn, 1):
        assert guard.write(my_conn, [CasRow(r[0], (r[1],), (f"w{r[0]}",)) for r in batch[:2]], key_version=2).written == [1, 2]
    run(app_conn, "UPDATE `p%s` SET `c%%` = 'app' WHERE `i%d` = 3")  # no parameters: no % doubled
    app_conn.commit()
    with batch_transaction(my_conn, 1):
        assert guard.write(my_conn, [CasRow(3, ("v3",), ("w3",))], key_version=2).changed == [3]
    rows = run(my_conn, "SELECT * FROM `p%s` ORDER BY 1")
    assert rows[:2] == [(1, "w1", 2, OLD_TIME), (2, "w2", 2, OLD_TIME)] and rows[2][:3] == (3, "app", 1)


@pytest.fixture
def persons(my_conn: MySqlConnection) -> MySqlCasGuard:
    run(my_conn, "CREATE TABLE persons (id BIGINT PRIMARY KEY, c VARCHAR(50), kv INT NOT NULL)")
    for i in range(1, 7):
        run(my_conn, "INSERT INTO persons VALUES (%s, %s, 1)", (i, f"old-{i}"))
    table = CATALOG.read_table(my_conn, None, "persons")
    assert table is not None
    return MySqlCasGuard(table, "id", ["c"], key_version="kv", stale_where="t.`kv` < 2")


def test_rows_written_again_unchanged_count_as_written_on_a_connection_counting_changed_rows(
        mariadb: MariaDbServer, mysql_database: str, persons: MySqlCasGuard) -> None:
    """Without CLIENT_FOUND_ROWS (a plain PyMySQL connection) the UPDATE counts rows changed:
    rows that get their own values again make the count short, which must take the exact path,
    not report them changed."""
    conn = mariadb.connect(mysql_database)
    try:
        run(conn, "UPDATE persons SET kv = 2 WHERE id <= 3")
        table = persons.table
        guard = MySqlCasGuard(table, "id", ["c", "kv"])  # the key version as a written column, as the run has it
        rows = [CasRow(i, (f"old-{i}", 2 if i <= 3 else 1), (f"old-{i}" if i <= 3 else f"new-{i}", 2)) for i in range(1, 7)]
        with batch_transaction(conn, 1):
            outcome = guard.write(conn, rows)
        assert outcome.written == [1, 2, 3, 4, 5, 6] and not (outcome.changed or outcome.mismatched)
        assert run(conn, "SELECT id, c, kv FROM persons ORDER BY id") == [
            (1, "old-1", 2), (2, "old-2", 2), (3, "old-3", 2), (4, "new-4", 2), (5, "new-5", 2), (6, "new-6", 2)]
    finally:
        conn.close()


def test_skipped_changed_and_mismatched_rows_in_one_batch(my_conn: MySqlConnection, app_conn: MySqlConnection,
                                                          persons: MySqlCasGuard) -> None:
    """Every count short at once: a row held (skipped), a row edited and one moved out of scope
    (changed: the UPDATE undone to the savepoint, the rest written again), a row a trigger
    rewrites (mismatched, read back and compared here)."""
    run(my_conn, "CREATE TRIGGER persons_upd BEFORE UPDATE ON persons FOR EACH ROW"
                 " SET NEW.c = IF(NEW.id = 6, 'trigger-made', NEW.c)")
    batch = persons.read_batch(my_conn, None, None, 10)
    run(app_conn, "UPDATE persons SET c = 'edited' WHERE id = 2")
    run(app_conn, "UPDATE persons SET kv = 5 WHERE id = 3")
    app_conn.commit()
    run(app_conn, "SELECT id FROM persons WHERE id = 4 FOR UPDATE")
    with pytest.raises(RuntimeError), batch_transaction(my_conn, 1):
        outcome = persons.write(my_conn, [CasRow(r[0], (r[1],), (f"new-{r[0]}",)) for r in batch], key_version=2)
        assert (outcome.written, outcome.changed, outcome.skipped, outcome.mismatched) == ([1, 5], [2, 3], [4], [6])
        assert outcome.stored[6] == ("trigger-made", 2) and outcome.stored[1] == ("new-1", 2)
        raise RuntimeError("a mismatch rolls the batch back")
    app_conn.rollback()
    assert run(my_conn, "SELECT id, c, kv FROM persons ORDER BY id") == [
        (1, "old-1", 1), (2, "edited", 1), (3, "old-3", 5), (4, "old-4", 1), (5, "old-5", 1), (6, "old-6", 1)]


def test_the_counting_lock_holds_every_row_it_counts(my_conn: MySqlConnection, app_conn: MySqlConnection,
                                                     persons: MySqlCasGuard) -> None:
    """The lock is a ``COUNT(*) ... FOR UPDATE SKIP LOCKED``: it must lock the rows it counts (an
    application then cannot take them) and skip, not wait on, a row the application holds."""
    run(app_conn, "SELECT id FROM persons WHERE id = 2 FOR UPDATE")
    rows = [CasRow(i, (f"old-{i}",), (f"new-{i}",)) for i in (1, 2, 3)]
    with batch_transaction(my_conn, 1):
        assert persons._lock(my_conn, rows) == {1, 3}  # not all: the ids locked, read again
        with pytest.raises(pymysql.err.OperationalError, match="1205"):
            run(app_conn, "SELECT id FROM persons WHERE id = 3 FOR UPDATE NOWAIT")
        assert persons._lock(my_conn, [rows[0], rows[2]]) is None  # all of them: one count, its own locks
    app_conn.rollback()
    with batch_transaction(my_conn, 1):
        assert persons._lock(my_conn, rows) is None
        with pytest.raises(pymysql.err.OperationalError, match="1205"):
            run(app_conn, "SELECT id FROM persons WHERE id = 2 FOR UPDATE NOWAIT")


def test_the_counting_lock_locks_too_when_mariadb_turns_a_long_id_list_into_a_join(
        my_conn: MySqlConnection, app_conn: MySqlConnection, persons: MySqlCasGuard) -> None:
    """From 1,000 values on (``in_predicate_conversion_threshold``) MariaDB reads ``IN (...)`` as a
    join with a table of the values: the rows it counts are still locked, a held one still skipped."""
    run(app_conn, "SELECT id FROM persons WHERE id = 5 FOR UPDATE")
    rows = [CasRow(i, ("x",), ("y",)) for i in range(1, 1201)]  # ids 7.. are gone: not locked, not waited on
    with batch_transaction(my_conn, 1):
        assert persons._lock(my_conn, rows) == {1, 2, 3, 4, 6}
        app_conn.rollback()
        with pytest.raises(pymysql.err.OperationalError, match="1205"):
            run(app_conn, "SELECT id FROM persons WHERE id = 6 FOR UPDATE NOWAIT")
