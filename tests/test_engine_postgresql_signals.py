# ruff: noqa: F811 - the engine fixture is imported from test_engine_postgresql_gate and named by each test
"""The PostgreSQL room's throttle signals and advisory lock (``engines/postgresql/signals.py``,
``base.checks.ThrottleSignals`` / ``AdvisoryLock``), on real servers: what ``room.ROOM.signals`` and
``ROOM.lock`` answer, as the MySQL room's are tested in test_engine_mysql_gate.py."""

from __future__ import annotations

import secrets
import threading
import time

import psycopg
import pytest
import sqlalchemy as sa

from pinrotate_core.engines.postgresql.room import ROOM
from pinrotate_core.engines.postgresql.signals import replay_position
from pinrotate_core.errors import DatabaseError
from tests.test_engine_postgresql_gate import engine  # noqa: F401 - the room's engine on the server under test


def test_load_counts_a_busy_application_session_and_the_reading_one(engine: sa.Engine, database_url: str) -> None:
    with ROOM.raw_connection(engine) as conn:
        idle = ROOM.signals.load(conn)
        assert idle.threads_running >= 1 and idle.facts == {"own_sessions_left_out": True}
        # An application session in a statement (its own application name, not ours) is busy.
        app = psycopg.connect(database_url, autocommit=True, application_name="profile-service")
        sleeper = threading.Thread(target=lambda: app.execute("SELECT pg_sleep(3)"))
        sleeper.start()
        try:
            deadline = time.monotonic() + 10
            while ROOM.signals.load(conn).threads_running < 2:
                assert time.monotonic() < deadline, "the busy application session was never counted"
                time.sleep(0.05)
        finally:
            sleeper.join()  # closed only once its statement has returned (libpq aborts otherwise)
            app.close()


def test_a_primary_without_standbys_has_no_replica_positions_and_is_no_replica(engine: sa.Engine) -> None:
    with ROOM.raw_connection(engine) as conn:
        assert ROOM.signals.replica_lag(conn) == []
        assert replay_position(conn) is None  # pg_is_in_recovery() is false on a primary


def test_the_advisory_lock_is_held_by_one_session_at_a_time_and_released_after(engine: sa.Engine) -> None:
    name = f"pinrotate-test-{secrets.token_hex(4)}"
    with ROOM.raw_connection(engine) as first, ROOM.raw_connection(engine) as second:
        with ROOM.lock.held(first, name) as got:
            assert got
            with ROOM.lock.held(second, name) as other:
                assert not other  # answered at once, never waited on
        with ROOM.lock.held(second, name) as again:
            assert again


def test_the_advisory_lock_on_a_lost_connection_is_one_line(engine: sa.Engine) -> None:
    with ROOM.raw_connection(engine) as conn:
        conn.close()
        with pytest.raises(DatabaseError, match="cannot take the single-instance lock"), \
                ROOM.lock.held(conn, "pinrotate-test-lost"):
            pass


def test_a_batchs_settings_hold_for_its_transaction_only(engine: sa.Engine) -> None:
    from pinrotate_core.engines.postgresql.session import batch_settings

    show = "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), " \
           "current_setting('idle_in_transaction_session_timeout'), current_setting('synchronous_commit')"
    with ROOM.raw_connection(engine) as conn:
        before = conn.execute(show).fetchone()
        with conn.transaction():
            for statement in batch_settings(0.2, 30, 60, dry_run=False):
                conn.execute(statement)
            assert conn.execute(show).fetchone() == ("200ms", "30s", "1min", "off")
        # SET LOCAL: nothing reaches the session (a transaction pooler's next client) after COMMIT.
        assert conn.execute(show).fetchone() == before
        with conn.transaction():
            for statement in batch_settings(0.2, 30, 60, dry_run=True):
                conn.execute(statement)
            assert conn.execute(show).fetchone()[3] == before[3]  # a dry run writes nothing to commit
