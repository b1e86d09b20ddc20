"""The throttle's row-lock watch on MySQL / MariaDB (issue 32), on the real server: an application
session waiting for a row a draining session holds is counted, on the drained tables only; one
waiting on another application's row is not; the throttle backs off while it waits; a role that
may not see lock waits is told once and not watched; a drain marks its session while it drains."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pymysql
import pytest
import sqlalchemy as sa

from pinrotate_core.engines.mysql.connect import MySqlConnection, raw_connection
from pinrotate_core.engines.mysql.signals import DRAIN_MARK, LockWaitsHidden, drain_session, sessions_blocked_by_drains
from pinrotate_core.throttle import BatchSizer, ThrottleLimits
from pinrotate_core.throttle.mysql import MySqlThrottle
from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

# Counts of lock waits and of marked sessions are server-wide: on the shared MariaDB another
# worker's drain would show in them. The module has a mariadbd of its own, its tests on one worker.
pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_engine_mysql_lock_watch")]

MARKED = ("SELECT COUNT(*) FROM information_schema.PROCESSLIST"
          " WHERE IS_USED_LOCK(CONCAT(%s, ID)) = ID")


def _connect(server: MariaDbServer, database: str, user: str = "root", password: str = "") -> MySqlConnection:
    return pymysql.connect(host=server.host, port=server.port, user=user, password=password, database=database,
                           autocommit=True)


def _run(conn: MySqlConnection, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with conn.cursor() as cur:
        cur.execute(statement, params)
        return list(cur.fetchall())


@contextlib.contextmanager
def _waiting_update(server: MariaDbServer, database: str, row_id: int) -> Iterator[threading.Thread]:
    """An application session updating row ``row_id`` of ``t``, in a thread: it waits while someone holds the row."""
    app = _connect(server, database)
    _run(app, "SET SESSION innodb_lock_wait_timeout = 20")
    thread = threading.Thread(target=_run, args=(app, "UPDATE t SET v = 'app' WHERE id = %s", (row_id,)), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        thread.join(timeout=30)
        app.close()


def _until(count: Callable[[], int], expected: int, timeout: float = 10.0) -> int:
    """``count()`` once it says ``expected``, or its last answer. InnoDB's lock tables are a cache
    refreshed only when it has not been read for 0.1 s: a faster poll would keep it as it was."""
    deadline = time.monotonic() + timeout
    while (seen := count()) != expected and time.monotonic() < deadline:
        time.sleep(0.25)
    return seen


@pytest.fixture
def table(mariadb: MariaDbServer, mysql_database: str) -> Iterator[None]:
    with contextlib.closing(_connect(mariadb, mysql_database)) as conn:
        _run(conn, "CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(20))")
        _run(conn, "CREATE TABLE other (id INT PRIMARY KEY, v VARCHAR(20))")
        _run(conn, "INSERT INTO t VALUES (1, 'a'), (2, 'b')")
        _run(conn, "INSERT INTO other VALUES (1, 'a')")
    yield


def test_a_session_waiting_on_a_row_a_drain_holds_is_counted_on_the_drained_tables_only(
        mariadb: MariaDbServer, mysql_database: str, table: None) -> None:
    with contextlib.closing(_connect(mariadb, mysql_database)) as watcher, \
            contextlib.closing(_connect(mariadb, mysql_database)) as drainer:
        def blocked(*tables: str) -> int:
            return sessions_blocked_by_drains(watcher, tables)

        with drain_session(drainer):
            _run(drainer, "START TRANSACTION")
            _run(drainer, "SELECT COUNT(*) FROM t WHERE id = 1 FOR UPDATE SKIP LOCKED")
            with _waiting_update(mariadb, mysql_database, 1):
                assert _until(lambda: blocked("t"), 1) == 1
                assert blocked() == 1  # no tables named: any table
                assert blocked(f"{mysql_database}.t") == 1
                assert blocked("other") == 0
                assert blocked("elsewhere.t") == 0
                _run(drainer, "COMMIT")
            assert _until(lambda: blocked("t"), 0) == 0
        assert _run(watcher, MARKED, (DRAIN_MARK,)) == [(0,)]  # the mark went with the block

        # The same wait on an application's row (no mark): not the drain's doing.
        _run(drainer, "START TRANSACTION")
        _run(drainer, "SELECT COUNT(*) FROM t WHERE id = 2 FOR UPDATE")
        with _waiting_update(mariadb, mysql_database, 2) as app:
            time.sleep(0.5)
            assert app.is_alive() and blocked("t") == 0
            _run(drainer, "COMMIT")


def test_the_throttle_backs_off_while_an_application_waits_on_a_drains_row(
        mariadb: MariaDbServer, mysql_database: str, mysql_engine: sa.Engine, table: None) -> None:
    throttle = MySqlThrottle(mysql_engine, BatchSizer(10), ThrottleLimits(), tables=["t"])
    try:
        assert throttle.check().reason is None
        with raw_connection(mysql_engine) as drainer, drain_session(drainer):
            _run(drainer, "START TRANSACTION")
            _run(drainer, "SELECT COUNT(*) FROM t WHERE id = 1 FOR UPDATE SKIP LOCKED")
            with _waiting_update(mariadb, mysql_database, 1):
                deadline = time.monotonic() + 10
                while (state := throttle.check()).reason is None and time.monotonic() < deadline:
                    time.sleep(0.25)
                assert (state.reason, state.blocked) == ("locks", 1), state
                _run(drainer, "COMMIT")
        deadline = time.monotonic() + 10
        while (state := throttle.check()).reason is not None and time.monotonic() < deadline:
            time.sleep(0.25)
        assert (state.reason, state.blocked) == (None, 0), state
    finally:
        throttle.close()


def test_a_role_that_may_not_see_lock_waits_is_told_once_and_its_run_goes_on(
        mariadb: MariaDbServer, mysql_database: str, table: None, caplog: pytest.LogCaptureFixture) -> None:
    user = f"nolocks_{mysql_database}"[:32]
    with contextlib.closing(_connect(mariadb, mysql_database)) as root:
        _run(root, "CREATE USER %s@'%%' IDENTIFIED BY 'pw-test-only'", (user,))
        _run(root, f"GRANT SELECT, UPDATE ON `{mysql_database}`.* TO %s@'%%'", (user,))
    try:
        with contextlib.closing(_connect(mariadb, mysql_database, user=user, password="pw-test-only")) as conn, \
                pytest.raises(LockWaitsHidden, match="lacks the PROCESS privilege"):
            sessions_blocked_by_drains(conn, ("t",))
        engine = sa.create_engine("mysql+pymysql://", creator=lambda: _connect(mariadb, mysql_database, user=user,
                                                                              password="pw-test-only"))
        throttle = MySqlThrottle(engine, BatchSizer(10), ThrottleLimits(), tables=["t"])
        try:
            with caplog.at_level(logging.WARNING):
                assert throttle.check().reason is None
                assert throttle.check().reason is None
            hidden = [r for r in caplog.records if "throttle_signal_hidden" in r.getMessage()]
            assert len(hidden) == 1 and "PROCESS" in hidden[0].getMessage()
        finally:
            throttle.close()
            engine.dispose()
    finally:
        with contextlib.closing(_connect(mariadb, mysql_database)) as root:
            _run(root, "DROP USER %s@'%%'", (user,))


def test_a_mysql_drain_holds_its_mark_while_it_drains_and_not_after(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    from pinrotate_core import rotation
    from pinrotate_core.config import load_settings
    from tests.mysql_contract.pin_data import install_pin

    pin = install_pin(mariadb, mysql_database, tmp_path, persons=20, documents=0)
    pin.promote_new_key()
    settings = load_settings(pin.config(tables=("persons",), batch_size=5))
    seen: list[int] = []
    with contextlib.closing(_connect(mariadb, mysql_database)) as watcher:
        def control() -> None:  # the operator's switch, read by the drain before each batch
            seen.append(int(str(_run(watcher, MARKED, (DRAIN_MARK,))[0][0])))

        report = rotation.run_rotation(settings, throttle_control=control)
        assert report.targets["Person"].reencrypted == 20
        assert seen and min(seen) >= 1, seen
        assert _run(watcher, MARKED, (DRAIN_MARK,)) == [(0,)]
