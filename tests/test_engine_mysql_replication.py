"""Replication as the MySQL room sees it, on a real pair of MariaDB servers started here (the
fallback path of tests/mariadb_server.py: our own mariadbd in a temporary data directory): GTID
positions, waiting for them, each replica's status and lag, the heartbeat, a stopped replica."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.engines.mysql.catalog import read_only_reasons
from pinrotate_core.engines.mysql.connect import MySqlConnection
from pinrotate_core.engines.mysql.gate import GATE_CHECKS
from pinrotate_core.engines.mysql.replication import (
    HeartbeatUnavailable,
    create_heartbeat_sql,
    read_heartbeat,
    remove_heartbeat,
    replica_status,
    wait_for_position,
    write_heartbeat,
)
from pinrotate_core.engines.mysql.signals import THROTTLE_SIGNALS
from pinrotate_core.rotation import retire_gate
from pinrotate_core.throttle.mysql import HeartbeatMeter
from tests.mariadb_server import MariaDbServer, free_port, machine_server, start_own_server
from tests.test_gate_discover import fpc1_settings, fpc1_value


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


def _heartbeat_table(p: MySqlConnection, r: MySqlConnection) -> None:
    run(p, "CREATE DATABASE IF NOT EXISTS pinrotate")
    with p.cursor() as cur:
        cur.execute(create_heartbeat_sql(), ())  # composed of quoted names: run with a parameter tuple
    position = GATE_CHECKS.primary_position(p)
    assert position and wait_for_position(r, position, 20)


def test_a_heartbeat_stamp_reaches_the_replica_exactly_and_goes_with_its_writer(
        pair: tuple[MariaDbServer, MariaDbServer]) -> None:
    primary, replica = pair
    with contextlib.closing(primary.connect()) as p, contextlib.closing(replica.connect()) as r:
        _heartbeat_table(p, r)
        with pytest.raises(HeartbeatUnavailable, match="has no table pinrotate.elsewhere"):
            read_heartbeat(r, "writer-a", table="elsewhere")  # a replica without the table: said, not None
        stamp = datetime(2026, 12, 6, 14, 52, 31, 123456)
        write_heartbeat(p, "writer-a", stamp)
        assert read_heartbeat(r, "writer-b") is None
        position = GATE_CHECKS.primary_position(p)
        assert position and wait_for_position(r, position, 20)
        assert read_heartbeat(r, "writer-a") == stamp  # to the microsecond
        remove_heartbeat(p, "writer-a")
        position = GATE_CHECKS.primary_position(p)
        assert position and wait_for_position(r, position, 20)
        assert read_heartbeat(r, "writer-a") is None


def test_the_heartbeat_meter_counts_how_long_the_oldest_stamp_a_replica_lacks_has_waited() -> None:
    meter = HeartbeatMeter("w")
    assert meter.lag(None) is None  # nothing stamped yet
    t0 = datetime(2026, 1, 1)
    meter._sent.extend([(t0, 10.0), (t0 + timedelta(seconds=1), 11.0), (t0 + timedelta(seconds=2), 12.0)])
    now = time.monotonic()
    assert meter.lag(t0 + timedelta(seconds=2)) == 0.0  # holds the newest
    lag = meter.lag(t0)  # lacks the second: waited since it was written
    assert lag is not None and lag >= now - 11.0
    lag = meter.lag(None)  # holds none of them
    assert lag is not None and lag >= now - 10.0
    meter.applied_by_all([t0 + timedelta(seconds=1), None])  # one replica holds none: nothing forgotten
    assert len(meter._sent) == 3
    meter.applied_by_all([t0 + timedelta(seconds=1), t0 + timedelta(seconds=5)])
    assert [s for s, _ in meter._sent] == [t0 + timedelta(seconds=2)]
    meter.applied_by_all([t0 + timedelta(seconds=9)])
    assert len(meter._sent) == 1  # the newest is always kept


def test_a_writing_run_measures_lag_by_its_heartbeat_which_sees_what_the_status_cannot(
        pair: tuple[MariaDbServer, MariaDbServer], caplog: pytest.LogCaptureFixture) -> None:
    """The replica applies everything but the heartbeat (a replication filter): its status says
    0 s behind, its stamps say otherwise, and the drain waits. A dry run writes no stamp; without
    the table the status alone counts, said once."""
    from pinrotate_core.engines.mysql.connect import make_engine
    from pinrotate_core.throttle.mysql import MySqlThrottle

    primary, replica = pair
    with contextlib.closing(primary.connect()) as p, contextlib.closing(replica.connect()) as r:
        run(p, "CREATE DATABASE IF NOT EXISTS app")
        _heartbeat_table(p, r)
        engine = make_engine(primary.url("app"), pool_size=1)
        settings = _settings(primary.url("app"), replica.url("app"), max_replica_lag=0.3)
        dry = MySqlThrottle.for_run(engine, settings, control=None, run_id="dry", writes=False)
        try:
            assert dry.heartbeat is None and dry.check().reason is None
            assert run(p, "SELECT COUNT(*) FROM pinrotate.heartbeat") == [(0,)]  # a dry run wrote nothing
        finally:
            dry.close()

        run(r, "STOP SLAVE")
        run(r, "SET GLOBAL replicate_wild_ignore_table = 'pinrotate.heartbeat'")
        run(r, "START SLAVE")
        writing = MySqlThrottle.for_run(engine, settings, control=None, run_id="run-1", writes=True)
        try:
            assert writing.heartbeat is not None
            writing.check()
            time.sleep(0.6)  # the stamp never arrives; nothing else is behind
            (status,) = replica_status(r)
            assert status.running and status.lag_s is not None and status.lag_s < 0.3, status
            state = writing.check()
            assert state.reason == "lag" and state.replica_lag is not None and state.replica_lag >= 0.5, state
            assert run(p, "SELECT COUNT(*) FROM pinrotate.heartbeat WHERE writer LIKE 'run-1-%%'") == [(1,)]
        finally:
            writing.close()  # its row goes (on the primary: the filter still skips it on the replica)
            # Every heartbeat event applied (skipped) under the filter before it is lifted: one left
            # in the relay log would then meet a row the replica never had, and stop replication.
            position = GATE_CHECKS.primary_position(p)
            assert position and wait_for_position(r, position, 20)
            run(r, "STOP SLAVE")
            run(r, "SET GLOBAL replicate_wild_ignore_table = ''")
            run(r, "START SLAVE")
        assert run(p, "SELECT COUNT(*) FROM pinrotate.heartbeat") == [(0,)]

        caught_up = MySqlThrottle.for_run(engine, settings, control=None, run_id="run-2", writes=True)
        try:
            deadline = time.monotonic() + 20
            while (state := caught_up.check()).reason is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert state.reason is None and state.replica_lag is not None and state.replica_lag < 0.3, state
        finally:
            caught_up.close()

        run(p, "DROP TABLE pinrotate.heartbeat")
        absent = MySqlThrottle.for_run(engine, settings, control=None, run_id="run-3", writes=True)
        try:
            with caplog.at_level(logging.WARNING):
                assert absent.check().reason is None  # the status alone counts
                time.sleep(0.15)
                assert absent.check().reason is None
            hidden = [rec.getMessage() for rec in caplog.records if "throttle_signal_hidden" in rec.getMessage()]
            assert len(hidden) == 1 and "replica_heartbeat" in hidden[0] and "pinrotate.heartbeat" in hidden[0], hidden
        finally:
            absent.close()
            engine.dispose()


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


def _settings(url: str, replica_url: str, *, max_replica_lag: float) -> Settings:
    """A run's settings as a configuration file gives them: the primary, the replica named, one target."""
    return settings_from_mapping({
        "database": {"url": url, "replicas": [replica_url]},
        "keys": {"provider": "env"},
        "job": {"max_replica_lag": max_replica_lag},
        "targets": [{"name": "T", "table": "t", "key_version": "key_version", "columns": ["c"]}]}, env={})


def test_a_replica_without_the_heartbeat_table_is_read_by_its_status_and_the_stamping_stops(
        pair: tuple[MariaDbServer, MariaDbServer], caplog: pytest.LogCaptureFixture) -> None:
    """A server named as a replica that has no ``pinrotate.heartbeat`` (as a replication filter
    leaving the database out would make it): said once, with its name; once no replica has the
    table the primary is stamped no more, and the row already written goes at the end."""
    from pinrotate_core.engines.mysql.connect import make_engine
    from pinrotate_core.throttle.mysql import MySqlThrottle

    primary, _ = pair
    elsewhere = start_own_server()  # answers, holds no pinrotate database, replicates nothing
    try:
        with contextlib.closing(primary.connect()) as p, contextlib.closing(elsewhere.connect()) as e:
            run(p, "CREATE DATABASE IF NOT EXISTS app")
            run(p, "CREATE DATABASE IF NOT EXISTS pinrotate")
            with p.cursor() as cur:
                cur.execute(create_heartbeat_sql(), ())
            run(e, "CREATE DATABASE IF NOT EXISTS app")
            engine = make_engine(primary.url("app"), pool_size=1)
            throttle = MySqlThrottle.for_run(engine, _settings(primary.url("app"), elsewhere.url("app"),
                                                               max_replica_lag=5.0),
                                             control=None, run_id="run-4", writes=True)
            try:
                with caplog.at_level(logging.WARNING):
                    state = throttle.check()
                    assert state.reason == "lag" and state.replica_lag is None  # not a replica: unknown, waits
                    time.sleep(0.15)
                    throttle.check()
                said = [r.getMessage() for r in caplog.records if "signal=replica_heartbeat" in r.getMessage()]
                assert len(said) == 1 and "has no table pinrotate.heartbeat" in said[0], said
                assert throttle.heartbeat is not None and throttle.heartbeat.off is not None
                assert run(p, "SELECT COUNT(*) FROM pinrotate.heartbeat WHERE writer LIKE 'run-4-%%'") == [(1,)]
            finally:
                throttle.close()
                engine.dispose()
            assert run(p, "SELECT COUNT(*) FROM pinrotate.heartbeat WHERE writer LIKE 'run-4-%%'") == [(0,)]
    finally:
        elsewhere.stop()


def test_the_gate_on_a_primary_with_a_replica_opens_only_once_that_replica_named_has_applied_the_look(
        pair: tuple[MariaDbServer, MariaDbServer], tmp_path: Path) -> None:
    """Contract §6 on MySQL: every replica caught up. A replica reading the primary's binary log is
    checked through ``[database] replicas`` (it must replicate from this server and reach the
    primary's GTID position after the look within ``[gate] wait``); unnamed, stopped or not this
    server's, the gate stays closed, STANDBY_BEHIND, named."""
    primary, replica = pair
    with primary.fresh_database() as database:
        with contextlib.closing(primary.connect(database)) as conn:
            run(conn, "CREATE TABLE secrets (id bigint PRIMARY KEY, secret text, doc json)")
            for i in range(1, 4):
                run(conn, "INSERT INTO secrets (id, secret) VALUES (%s, %s)", (i, fpc1_value("k3")))
        settings = fpc1_settings(primary.url(database), tmp_path / "keys.toml")
        settings = settings.model_copy(update={"gate": settings.gate.model_copy(update={"wait": 5})})

        def with_replicas(*urls: str) -> Settings:
            return settings.model_copy(update={"database": settings.database.model_copy(update={"replicas": urls})})

        unnamed = retire_gate(settings, "k1")
        assert not unnamed.open and unnamed.blocking["STANDBY_BEHIND"] == 1
        assert "name each in [database] replicas" in str(unnamed.durability["reason"])

        named_replica = retire_gate(with_replicas(replica.url("mysql")), "k1")
        assert named_replica.open, named_replica.durability
        assert named_replica.durability["replicas_checked"] == [replica.url("mysql")]

        not_ours = retire_gate(with_replicas(primary.url("mysql")), "k1")  # the primary replicates from nobody
        assert not not_ours.open and "does not replicate from this server" in str(not_ours.durability["reason"])

        with contextlib.closing(replica.connect()) as r:
            run(r, "STOP SLAVE SQL_THREAD")
            try:
                with contextlib.closing(primary.connect(database)) as conn:
                    run(conn, "INSERT INTO secrets (id, secret) VALUES (9, %s)", (fpc1_value("k3"),))
                stopped = retire_gate(with_replicas(replica.url("mysql")), "k1")
            finally:
                run(r, "START SLAVE SQL_THREAD")
        assert not stopped.open and stopped.blocking["STANDBY_BEHIND"] == 1
        assert "has not applied" in str(stopped.durability["reason"]), stopped.durability
        assert retire_gate(with_replicas(replica.url("mysql")), "k1").open  # caught up again
