"""Replication as the MySQL room sees it, on a real pair of MariaDB servers started here (the
fallback path of tests/mariadb_server.py: our own mariadbd in a temporary data directory): GTID
positions, waiting for them, each replica's status and lag, the heartbeat, a stopped replica."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from pinrotate_core.engines.mysql.catalog import read_only_reasons
from pinrotate_core.engines.mysql.connect import MySqlConnection
from pinrotate_core.engines.mysql.gate import GATE_CHECKS
from pinrotate_core.engines.mysql.replication import (
    create_heartbeat_sql,
    heartbeat_lag,
    replica_status,
    wait_for_position,
    write_heartbeat,
)
from pinrotate_core.engines.mysql.signals import THROTTLE_SIGNALS
from tests.mariadb_server import MariaDbServer, free_port, machine_server, start_own_server


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[MariaDbServer, MariaDbServer]]:
    primary = start_own_server(extra_args=["--log-bin=primary-bin", "--server-id=1", "--binlog-format=ROW"])
    replica = None
    try:
        replica = start_own_server(extra_args=["--server-id=2", "--read-only=ON"])
        with contextlib.closing(replica.connect()) as conn, conn.cursor() as cur:
            cur.execute(f"CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={primary.port}, MASTER_USER='root',"
                        " MASTER_PASSWORD='', MASTER_USE_GTID=slave_pos, MASTER_CONNECT_RETRY=1")
            cur.execute("START SLAVE")
        yield primary, replica
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()


def run(conn: MySqlConnection, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with conn.cursor() as cur:
        cur.execute(statement, params or None)
        return list(cur.fetchall())


def test_our_own_servers_answer_on_free_ports(pair: tuple[MariaDbServer, MariaDbServer]) -> None:
    primary, replica = pair
    assert primary.owned and replica.owned and primary.port != replica.port != 3306


def test_no_machine_server_where_nothing_answers_so_the_tests_start_their_own() -> None:
    assert machine_server(port=free_port()) is None


def test_a_replica_caught_up_with_the_primary_gtid_position(pair: tuple[MariaDbServer, MariaDbServer]) -> None:
    primary, replica = pair
    with contextlib.closing(primary.connect()) as p, contextlib.closing(replica.connect()) as r:
        run(p, "CREATE DATABASE IF NOT EXISTS app")
        run(p, "CREATE TABLE IF NOT EXISTS app.t (id INT PRIMARY KEY, c TEXT)")
        run(p, "REPLACE INTO app.t VALUES (1, 'x')")
        position = GATE_CHECKS.primary_position(p)
        assert position is not None and position.startswith("0-1-")  # MariaDB: domain-server-seqno
        assert wait_for_position(r, position, 20)
        assert run(r, "SELECT c FROM app.t WHERE id = 1") == [("x",)]
        (status,) = replica_status(r)
        assert status.running and status.lag_s is not None and status.lag_s >= 0
        assert status.name == f"127.0.0.1:{primary.port}" and status.position == position
        assert [s.running for s in THROTTLE_SIGNALS.replica_lag(r)] == [True]
        assert replica_status(p) == []  # the primary replicates from nobody
        assert read_only_reasons(r) == ("@@read_only = ON",) and read_only_reasons(p) == ()
        # Binary log on, sync_binlog = 0 (MariaDB's default): not durable at every commit.
        durability = GATE_CHECKS.durability(p)
        assert not durability.durable and any("sync_binlog = 0" in why for why in durability.reasons)


def test_the_heartbeat_measures_the_replicas_delay(pair: tuple[MariaDbServer, MariaDbServer]) -> None:
    primary, replica = pair
    with contextlib.closing(primary.connect()) as p, contextlib.closing(replica.connect()) as r:
        run(p, "CREATE DATABASE IF NOT EXISTS pinrotate")
        with p.cursor() as cur:
            cur.execute(create_heartbeat_sql(), ())  # composed of quoted names: run with a parameter tuple
        write_heartbeat(p)
        position = GATE_CHECKS.primary_position(p)
        assert position and wait_for_position(r, position, 20)
        lag = heartbeat_lag(r)
        assert lag is not None and 0 <= lag < 10


def test_a_stopped_replica_is_not_caught_up_and_has_no_lag_figure(pair: tuple[MariaDbServer, MariaDbServer]) -> None:
    primary, replica = pair
    with contextlib.closing(primary.connect()) as p, contextlib.closing(replica.connect()) as r:
        run(p, "CREATE DATABASE IF NOT EXISTS app")
        run(p, "CREATE TABLE IF NOT EXISTS app.t (id INT PRIMARY KEY, c TEXT)")
        run(r, "STOP SLAVE SQL_THREAD")
        try:
            run(p, "REPLACE INTO app.t VALUES (2, 'behind')")
            position = GATE_CHECKS.primary_position(p)
            assert position is not None
            assert not wait_for_position(r, position, 0.3)
            (status,) = replica_status(r)
            assert not status.running and status.lag_s is None
            assert status.problem is not None and status.problem.startswith("replication not running (IO Yes, SQL No")
        finally:
            run(r, "START SLAVE SQL_THREAD")
        assert wait_for_position(r, position, 20)  # and it catches up once started again


def test_the_throttle_on_mysql_waits_for_a_stopped_replica_and_for_replicas_no_url_names(
        pair: tuple[MariaDbServer, MariaDbServer]) -> None:
    from pinrotate_core.engines.mysql.connect import make_engine
    from pinrotate_core.throttle import BatchSizer, ThrottleLimits
    from pinrotate_core.throttle.mysql import ATTACHED, MySqlThrottle

    primary, replica = pair
    with contextlib.closing(primary.connect()) as p, contextlib.closing(replica.connect()) as r:
        run(p, "CREATE DATABASE IF NOT EXISTS app")
        position = GATE_CHECKS.primary_position(p)
        assert position is not None and wait_for_position(r, position, 20)
        engine = make_engine(primary.url("app"), pool_size=1)
        named = MySqlThrottle(engine, BatchSizer(10), ThrottleLimits(max_replica_lag=5.0),
                              replicas=[replica.url("app")])
        unnamed = MySqlThrottle(engine, BatchSizer(10), ThrottleLimits(max_replica_lag=5.0))
        try:
            state = named.check()
            assert state.reason is None and state.replica_lag is not None and state.replica_lag < 5, state
            # Replicas read the primary's binary log, but no URL names them: their lag is unknown (fail-safe).
            state = unnamed.check()
            assert (state.reason, state.lagging) == ("lag", ATTACHED), state
            run(r, "STOP SLAVE SQL_THREAD")
            try:
                state = named.check()
                assert state.reason == "lag" and state.replica_lag is None, state
                assert named.state()["status"] == "waiting_for_lag"
            finally:
                run(r, "START SLAVE SQL_THREAD")
            assert named.check().reason is None  # resumes once replication runs again
        finally:
            named.close()
            unnamed.close()
            engine.dispose()
