"""The MySQL room's gate checks, throttle signals and advisory lock, on the real MariaDB. The
server may be shared with other test sessions: every assertion looks at what this test made."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator

import pymysql
import pytest

from pinrotate_core.engines.mysql.connect import MySqlConnection, make_engine, raw_connection
from pinrotate_core.engines.mysql.gate import GATE_CHECKS, INNODB_TRX_CACHE_S
from pinrotate_core.engines.mysql.signals import ADVISORY_LOCK, SINGLE_INSTANCE_LOCK, THROTTLE_SIGNALS
from pinrotate_core.engines.mysql.sweep import stream_values
from pinrotate_core.errors import DatabaseError
from tests.mariadb_server import MariaDbServer


@pytest.fixture
def app_conn(mariadb: MariaDbServer, mysql_database: str) -> Iterator[MySqlConnection]:
    conn = mariadb.connect(mysql_database, autocommit=False)
    yield conn
    with contextlib.suppress(pymysql.Error):
        conn.rollback()
    conn.close()


def run(conn: MySqlConnection, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with conn.cursor() as cur:
        cur.execute(statement, params or None)
        return list(cur.fetchall())


def test_the_snapshot_sees_one_moment_and_writes_nothing(my_conn: MySqlConnection, app_conn: MySqlConnection) -> None:
    run(my_conn, "CREATE TABLE t (id INT PRIMARY KEY, c TEXT)")
    run(my_conn, "INSERT INTO t VALUES (1, 'before')")
    with GATE_CHECKS.snapshot(my_conn):
        assert run(my_conn, "SELECT COUNT(*) FROM t") == [(1,)]
        run(app_conn, "INSERT INTO t VALUES (2, 'during')")
        app_conn.commit()
        assert run(my_conn, "SELECT COUNT(*) FROM t") == [(1,)]
        with pytest.raises(pymysql.err.MySQLError, match="1792"):  # a READ ONLY transaction
            run(my_conn, "INSERT INTO t VALUES (3, 'by the gate')")
    assert run(my_conn, "SELECT COUNT(*) FROM t") == [(2,)]


def test_candidate_columns_cover_text_json_and_binary_columns_of_every_database(
        mariadb: MariaDbServer, mysql_database: str, my_conn: MySqlConnection) -> None:
    other = mariadb.create_database()  # another database of the same server is swept too
    try:
        run(my_conn, "CREATE TABLE t (id INT PRIMARY KEY, c VARCHAR(80), b BLOB, j JSON, n INT, d DATETIME,"
                     " g VARCHAR(90) AS (UPPER(c)) VIRTUAL)")
        run(my_conn, "CREATE TABLE m (id INT PRIMARY KEY, note TEXT) ENGINE = MyISAM")
        run(my_conn, f"CREATE TABLE `{other}`.elsewhere (id INT PRIMARY KEY, secret LONGTEXT)")
        run(my_conn, "CREATE VIEW v AS SELECT c FROM t")
        found = {c.label: c for c in GATE_CHECKS.candidate_columns(my_conn) if c.schema in (mysql_database, other)}
    finally:
        mariadb.drop_database(other)
    assert sorted(found) == sorted([f"{mysql_database}.t.c", f"{mysql_database}.t.b", f"{mysql_database}.t.j",
                                    f"{mysql_database}.m.note", f"{other}.elsewhere.secret"])
    assert found[f"{mysql_database}.t.b"].binary and not found[f"{mysql_database}.t.c"].binary
    assert all(c.readable for c in found.values())
    assert not found[f"{mysql_database}.m.note"].transactional and found[f"{mysql_database}.t.c"].transactional
    assert not any(c.schema in ("mysql", "sys", "information_schema", "performance_schema")
                   for c in GATE_CHECKS.candidate_columns(my_conn))


def test_a_column_the_role_may_not_read_is_marked_unreadable(mariadb: MariaDbServer, mysql_database: str,
                                                              my_conn: MySqlConnection) -> None:
    run(my_conn, "CREATE TABLE open_t (id INT PRIMARY KEY, c TEXT)")
    run(my_conn, "CREATE TABLE write_only (id INT PRIMARY KEY, c TEXT)")
    user = f"pinrotate_t_{secrets.token_hex(4)}"
    admin = mariadb.connect()
    try:
        run(admin, f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")
        run(admin, f"GRANT SELECT ON `{mysql_database}`.open_t TO '{user}'@'%'")
        run(admin, f"GRANT INSERT ON `{mysql_database}`.write_only TO '{user}'@'%'")
        engine = make_engine(f"mysql://{user}:pw@{mariadb.host}:{mariadb.port}/{mysql_database}")
        try:
            with raw_connection(engine) as conn:
                found = {c.table: c.readable for c in GATE_CHECKS.candidate_columns(conn)}
                sees_all = GATE_CHECKS.sees_every_table(conn)
        finally:
            engine.dispose()
    finally:
        run(admin, f"DROP USER '{user}'@'%'")
        admin.close()
    assert found == {"open_t": True, "write_only": False}
    assert not sees_all  # tables it holds nothing on are hidden from it: the gate cannot vouch for them
    assert GATE_CHECKS.sees_every_table(my_conn)  # root: GRANT ALL ON *.*


def test_an_application_transaction_that_wrote_is_in_flight_until_it_ends(my_conn: MySqlConnection,
                                                                           app_conn: MySqlConnection) -> None:
    run(my_conn, "CREATE TABLE t (id INT PRIMARY KEY, c TEXT)")
    thread = int(str(run(app_conn, "SELECT CONNECTION_ID()")[0][0]))
    run(app_conn, "INSERT INTO t VALUES (1, 'uncommitted')")
    ours = [t for t in GATE_CHECKS.in_flight(my_conn) if t.session == thread]
    assert len(ours) == 1 and ours[0].user == "root" and ours[0].open_s >= 0
    assert "uncommitted" not in ours[0].describe()
    app_conn.commit()
    time.sleep(INNODB_TRX_CACHE_S * 1.5)  # InnoDB's cache of the view may still show it that long
    assert not [t for t in GATE_CHECKS.in_flight(my_conn) if t.session == thread]
    with GATE_CHECKS.snapshot(my_conn):  # the gate's own snapshot is not in flight for itself
        own = int(str(run(my_conn, "SELECT CONNECTION_ID()")[0][0]))
        run(my_conn, "SELECT COUNT(*) FROM t")
        assert own not in {t.session for t in GATE_CHECKS.in_flight(my_conn)}


def test_a_prepared_xa_transaction_is_listed_until_resolved(my_conn: MySqlConnection, app_conn: MySqlConnection) -> None:
    run(my_conn, "CREATE TABLE t (id INT PRIMARY KEY)")
    gtrid = f"pinrotate-test-{secrets.token_hex(4)}"
    app_conn.autocommit(True)
    run(app_conn, f"XA START '{gtrid}'")
    run(app_conn, "INSERT INTO t VALUES (1)")
    run(app_conn, f"XA END '{gtrid}'")
    run(app_conn, f"XA PREPARE '{gtrid}'")
    try:
        listed = GATE_CHECKS.prepared(my_conn)
        assert f"1:{gtrid.encode().hex()}:" in listed
    finally:
        run(app_conn, f"XA ROLLBACK '{gtrid}'")
    assert f"1:{gtrid.encode().hex()}:" not in GATE_CHECKS.prepared(my_conn)


def test_durability_settings_are_read_and_judged(my_conn: MySqlConnection) -> None:
    flush, sync_binlog, log_bin = run(my_conn, "SELECT @@innodb_flush_log_at_trx_commit, @@sync_binlog, @@log_bin")[0]
    durability = GATE_CHECKS.durability(my_conn)
    assert durability.settings["innodb_flush_log_at_trx_commit"] == flush
    expected = flush == 1 and (not log_bin or sync_binlog == 1)
    assert durability.durable is expected and bool(durability.reasons) is not expected
    # Without a binary log there is no GTID position to wait for; with one, it is a GTID set.
    position = GATE_CHECKS.primary_position(my_conn)
    assert (position is None) is (not log_bin)


def test_threads_running_counts_at_least_the_reading_session(my_conn: MySqlConnection) -> None:
    sample = THROTTLE_SIGNALS.load(my_conn)
    assert sample.threads_running >= 1 and sample.facts["threads_connected"] >= 1
    assert THROTTLE_SIGNALS.replica_lag(my_conn) == []  # the test server replicates from nobody


def test_the_advisory_lock_is_taken_once_and_never_waited_for(my_conn: MySqlConnection,
                                                              app_conn: MySqlConnection) -> None:
    name = f"{SINGLE_INSTANCE_LOCK}-{secrets.token_hex(3)}"  # this test's own, on a shared server
    with ADVISORY_LOCK.held(my_conn, name) as first:
        assert first
        with ADVISORY_LOCK.held(app_conn, name) as second:
            assert not second
    with ADVISORY_LOCK.held(app_conn, name) as third:
        assert third


def test_reading_in_flight_without_process_privilege_fails_closed(mariadb: MariaDbServer, mysql_database: str) -> None:
    user = f"pinrotate_t_{secrets.token_hex(4)}"
    admin = mariadb.connect()
    try:
        run(admin, f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")
        run(admin, f"GRANT SELECT ON `{mysql_database}`.* TO '{user}'@'%'")
        engine = make_engine(f"mysql://{user}:pw@{mariadb.host}:{mariadb.port}/{mysql_database}")
        try:
            with raw_connection(engine) as conn, pytest.raises(DatabaseError, match="PROCESS privilege"):
                GATE_CHECKS.in_flight(conn)
        finally:
            engine.dispose()
    finally:
        run(admin, f"DROP USER '{user}'@'%'")
        admin.close()


def test_the_sweep_streams_values_holding_the_marker_in_text_binary_and_json_columns(
        mysql_database: str, my_conn: MySqlConnection, app_conn: MySqlConnection) -> None:
    run(my_conn, "CREATE TABLE notes (id INT PRIMARY KEY, body TEXT CHARACTER SET latin1, raw BLOB, doc JSON,"
                 " other VARCHAR(20))")
    run(my_conn, "INSERT INTO notes VALUES (1, 'see FPC1:k1:abc here', NULL, NULL, 'FPC1:k9:x'),"
                 " (2, 'plain', X'00465043313a6b323a01', '{\"p\": \"FPC1:k3:zz\"}', NULL),"
                 " (3, NULL, X'0102', '{}', 'nothing')")
    columns = [c for c in GATE_CHECKS.candidate_columns(my_conn)
               if c.schema == mysql_database and c.table == "notes" and c.column != "other"]
    assert [c.column for c in columns] == ["body", "raw", "doc"]
    with GATE_CHECKS.snapshot(my_conn):
        run(app_conn, "INSERT INTO notes VALUES (4, 'FPC1:k4:after the snapshot', NULL, NULL, NULL)")
        app_conn.commit()
        found = sorted((columns[i].column, v if isinstance(v, str) else v.hex())
                       for i, v in stream_values(my_conn, columns, "FPC1:"))
        everything = list(stream_values(my_conn, columns))
    assert found == [("body", "see FPC1:k1:abc here"), ("doc", '{"p": "FPC1:k3:zz"}'),
                     ("raw", "00465043313a6b323a01")]
    assert len(everything) == 6  # every non-NULL value of the three columns, rows 1-3 only
