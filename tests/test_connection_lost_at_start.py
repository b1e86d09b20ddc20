"""A connection lost while SQLAlchemy first reads the server (its version and settings, on the
first connection of an engine) is the same one-line, retryable DatabaseUnavailable as a server that
cannot be reached, on both engines: a drain starting in a worker while an outage (or an operator's
``pg_terminate_backend`` / ``KILL``) ends its session is retried by the flow, never a task that "did
not finish" with SQLAlchemy's error (a CI run met this race in tests/test_flow_dask.py).

The kill is real: the connection the pool receives (an engine of the test's own, whose connect
step ends the session on the server) is gone before SQLAlchemy's first statement on it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pymysql
import pytest
import sqlalchemy as sa

from pinrotate_core.engines.mysql import connect as mysql_connect
from pinrotate_core.engines.postgresql import connect as pg_connect
from pinrotate_core.errors import DatabaseUnavailable
from tests.mariadb_server import MariaDbServer


def _until(done: Callable[[], bool]) -> None:
    """Wait until the server has ended the session (a kill is acted on asynchronously)."""
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, "the session was never ended"
        time.sleep(0.02)


def _assert_first_connection_unavailable(engine: sa.Engine,
                                         raw_connection: Callable[[sa.Engine], contextlib.AbstractContextManager[Any]]) -> None:
    """The room's ``raw_connection`` on ``engine`` (whose first connection is lost) raises
    DatabaseUnavailable with one retryable line; the engine is disposed either way."""
    try:
        with pytest.raises(DatabaseUnavailable) as caught, raw_connection(engine):
            pass
        _assert_one_retryable_line(caught.value)
    finally:
        engine.dispose()


def _assert_one_retryable_line(error: DatabaseUnavailable) -> None:
    assert error.retryable and "\n" not in str(error) and "cannot connect" in str(error), str(error)


def test_postgresql_a_session_ended_before_sqlalchemys_first_statement(primary_database_url: str) -> None:
    engine = sa.create_engine(pg_connect.sqlalchemy_url(primary_database_url), poolclass=sa.pool.NullPool)

    @sa.event.listens_for(engine, "do_connect")
    def ended(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        conn = psycopg.connect(*cargs, **cparams)
        with psycopg.connect(primary_database_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
            _until(lambda: not admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                                             (conn.info.backend_pid,)).fetchall())
        return conn

    _assert_first_connection_unavailable(engine, pg_connect.raw_connection)


@pytest.mark.mysql
def test_mariadb_a_session_killed_before_sqlalchemys_first_statement(mariadb: MariaDbServer,
                                                                     mysql_database: str) -> None:
    engine = sa.create_engine(mysql_connect.sqlalchemy_url(mariadb.url(mysql_database)), poolclass=sa.pool.NullPool)

    @sa.event.listens_for(engine, "do_connect")
    def killed(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        conn = pymysql.connect(*cargs, **cparams)
        with contextlib.closing(mariadb.connect(None)) as admin, admin.cursor() as cur:
            cur.execute("KILL %s", (conn.thread_id(),))

            def gone() -> bool:
                cur.execute("SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = %s", (conn.thread_id(),))
                return not cur.fetchall()

            _until(gone)
        return conn

    _assert_first_connection_unavailable(engine, mysql_connect.raw_connection)
