"""Sharing the database: the batch sizer (pure), and the throttle against a real primary, a real
streaming replica (``pg_basebackup -R``, replay paused and resumed), real busy and blocked sessions.

Nothing is timed: waits are polled until a state is reached (with generous bounds that only stop
a broken server from hanging the session), and the assertions are on states and counts.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from pinrotate_core.db import make_engine
from pinrotate_core.errors import ThrottleCritical
from pinrotate_core.metrics import RotationMetrics
from pinrotate_core.rotation import LOCK_NAME
from pinrotate_core.throttle import (
    LOCKS_POLL_INTERVAL,
    MAX_BATCH_SIZE,
    MAX_DELAY,
    REASON_LAG,
    REASON_LOAD,
    REASON_LOCKS,
    REASON_PAUSED,
    BatchSizer,
    OperatorControl,
    ReplicaLagMeter,
    Throttle,
    ThrottleControl,
    ThrottleLimits,
    parse_control,
    parse_lsn,
)

from .pg_replica import Replica, logical_decoding, pg_replica, replicated_database, wal_receiver  # noqa: F401

# xdist: every test of this module on one worker (one streaming replica of the worker's embedded server for the module).
pytestmark = pytest.mark.xdist_group("test_throttle")

BOUND_S = 60.0  # only a bound against a hang; never asserted on


def wait_until(condition: Callable[[], bool], what: str, bound: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.05)


# -- the batch sizer (pure) ---------------------------------------------------------------------


def test_a_fixed_batch_size_stays_fixed_whatever_the_batch_times() -> None:
    sizer = BatchSizer(200)
    for seconds in (0.001, 5.0, 0.5, 30.0):
        sizer.observe(seconds, 200)
        assert sizer.size == 200


def test_fast_batches_grow_the_size_by_at_most_ten_percent_per_batch_up_to_the_maximum() -> None:
    sizer = BatchSizer(100, target=0.5, minimum=50, maximum=300)
    sizes = []
    for _ in range(30):
        sizer.observe(0.01, sizer.size)  # far below the target
        sizes.append(sizer.size)
    steps = [b / a for a, b in zip([100, *sizes], sizes)]
    assert all(step <= 1.10 + 1e-9 for step in steps)
    assert sizes[0] == 110
    assert sizes[-1] == 300  # bounded by the maximum


def test_slow_batches_shrink_the_size_by_at_most_twenty_percent_per_batch_down_to_the_minimum() -> None:
    sizer = BatchSizer(1000, target=0.5, minimum=50, maximum=5000)
    sizes = []
    for _ in range(30):
        sizer.observe(20.0, sizer.size)  # far above the target
        sizes.append(sizer.size)
    steps = [b / a for a, b in zip([1000, *sizes], sizes)]
    assert all(step >= 0.80 - 1e-9 for step in steps)
    assert sizes[0] == 800
    assert sizes[-1] == 50


def test_the_size_follows_the_moving_average_toward_the_target_and_settles_there() -> None:
    # A database that needs 1 ms per row: the size that meets a 0.5 s target is 500 rows.
    sizer = BatchSizer(100, target=0.5, minimum=50, maximum=5000)
    for _ in range(200):
        sizer.observe(sizer.size * 0.001, sizer.size)
    assert 450 <= sizer.size <= 550
    settled = sizer.size
    sizer.observe(settled * 0.001, settled)
    assert sizer.size == settled  # inside the dead band: no more change


def test_halving_backs_off_at_once_and_a_fixed_size_grows_back_to_where_it_was() -> None:
    sizer = BatchSizer(400)
    sizer.halve()
    assert sizer.size == 200
    sizer.halve()
    assert sizer.size == 100
    for _ in range(30):
        sizer.observe(0.01, sizer.size)
    assert sizer.size == 400


def test_an_adaptive_size_grows_no_further_than_the_smallest_size_at_which_our_locks_blocked_a_session() -> None:
    sizer = BatchSizer(800, target=0.5, minimum=50, maximum=5000)
    sizer.halve()
    assert (sizer.size, sizer.blocked_at) == (400, 800)
    for _ in range(50):
        sizer.observe(0.001, sizer.size)  # far below the target: it would grow to 5000
    assert sizer.size == 800
    for _ in range(2):
        sizer.observe(10.0, sizer.size)  # slow: 800 -> 640 -> 512
    sizer.halve()
    assert (sizer.size, sizer.blocked_at) == (256, 512)
    for _ in range(50):
        sizer.observe(0.001, sizer.size)
    assert sizer.size == 512


def test_a_fixed_size_remembers_no_cap_and_the_throttle_state_is_plain_json() -> None:
    sizer = BatchSizer(400)
    sizer.halve()
    assert sizer.blocked_at is None
    throttle = Throttle(make_engine("postgresql://nobody@127.0.0.1:1/none"), sizer)
    state = throttle.state()
    assert state["status"] == "running" and state["batch_size"] == 200 and state["batch_size_cap"] is None
    assert state["waited_s"] == {REASON_LAG: 0.0, REASON_LOAD: 0.0, REASON_LOCKS: 0.0, REASON_PAUSED: 0.0}
    assert json.loads(json.dumps(state)) == state


def test_halving_never_goes_below_the_minimum_and_an_operator_override_wins_while_set() -> None:
    sizer = BatchSizer(120, target=0.5, minimum=50, maximum=5000)
    for _ in range(5):
        sizer.halve()
    assert sizer.size == 50
    sizer.override(777)
    assert sizer.size == 777
    sizer.override(None)
    assert sizer.size == 50


def test_a_fixed_size_below_the_adaptive_minimum_is_kept() -> None:
    assert BatchSizer(10, minimum=50).size == 10


@pytest.mark.parametrize("bad", [
    {"batch_size": 0, "target": None}, {"batch_size": 10, "target": 0.0}, {"batch_size": 10, "target": -1.0},
])
def test_nonsense_sizer_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BatchSizer(bad["batch_size"], target=bad["target"])


# -- the operator's switch (pure) -------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (None, ThrottleControl()),
    ({}, ThrottleControl()),
    ("", ThrottleControl()),
    ({"paused": True}, ThrottleControl(paused=True)),
    ({"paused": False, "batch_size": 500, "delay": 1}, ThrottleControl(batch_size=500, delay=1.0)),
    ('{"paused": true}', ThrottleControl(paused=True)),
])
def test_a_control_value_is_read_as_pause_batch_size_and_delay(value: Any, expected: ThrottleControl) -> None:
    assert parse_control(value) == expected


@pytest.mark.parametrize(("value", "problem"), [
    ({"paused": "yes"}, "paused: Input should be a valid boolean"),
    ({"batch_size": -5}, "batch_size: Input should be greater than or equal to 1"),
    ({"batch_size": 1.5}, "batch_size: Input should be a valid integer"),
    ({"batch_size": True}, "batch_size: Input should be a valid integer"),
    ({"batch_size": 10**23}, "batch_size: Input should be less than or equal to 100000"),
    ({"delay": "1s"}, "delay: Input should be a valid number"),
    ({"delay": 1e308}, "delay: Input should be less than or equal to 3600"),
    ('{"delay": Infinity}', "delay: Input should be a finite number"),
    ({"pause": True}, "unknown field pause"),
    ([1, 2], "not a JSON object"),
    ("{paused", "not valid JSON"),
])
def test_a_control_value_that_is_not_understood_pauses_and_names_the_problem(value: Any, problem: str) -> None:
    control = parse_control(value)
    assert control.paused is True
    assert control.invalid == problem


# -- against the real database ----------------------------------------------------------------


@pytest.fixture
def engine(replicated_database: str) -> Iterator[sa.Engine]:
    eng = make_engine(replicated_database, pool_size=3)
    try:
        yield eng
    finally:
        eng.dispose()


def write_some_wal(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS wal_maker (n int)")
        conn.execute("INSERT INTO wal_maker SELECT generate_series(1, 100)")


class Waiter:
    """``before_batch`` in a thread, so a test can look at it while it waits."""

    def __init__(self, throttle: Throttle, deadline: float | None = None) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(throttle, deadline), daemon=True)
        self.thread.start()

    def _run(self, throttle: Throttle, deadline: float | None) -> None:
        try:
            throttle.before_batch(self.stop, deadline)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e

    def returned(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> None:
        self.thread.join(BOUND_S)
        assert not self.thread.is_alive(), "before_batch did not return"
        if self.error is not None:
            raise self.error


def test_an_idle_primary_shows_no_replica_lag_however_long_it_stays_idle(
        engine: sa.Engine, pg_replica: Replica, replicated_database: str) -> None:
    meter = ReplicaLagMeter()
    readings: list[float | None] = []
    with engine.connect() as sa_conn:
        conn = sa_conn.connection.driver_connection
        assert isinstance(conn, psycopg.Connection)
        conn.autocommit = True
        pg_replica.wait_caught_up()
        for _ in range(20):
            lags = meter.measure(conn)
            assert lags, "the replica was not found in pg_stat_replication"
            readings.extend(lags.values())
            time.sleep(0.1)
    # Background WAL (a checkpoint, a running-xacts record) may be replayed a moment late; an
    # idle primary must never look like a replica falling further and further behind.
    assert all(r is not None for r in readings)
    assert max(r for r in readings if r is not None) < 1.0
    assert readings[-1] == min(r for r in readings if r is not None) or readings[-1] < 0.5


def test_the_rooms_signals_show_the_standby_from_the_primary_and_its_replay_position_on_it(
        engine: sa.Engine, pg_replica: Replica, replicated_database: str) -> None:
    from pinrotate_core.engines.postgresql.room import ROOM
    from pinrotate_core.engines.postgresql.signals import replay_position

    pg_replica.wait_caught_up()
    with ROOM.raw_connection(engine) as conn:
        positions = ROOM.signals.replica_lag(conn)
    assert len(positions) == 1, positions
    standby = positions[0]
    # Running, with the position it replayed; its lag in seconds is the meter's to measure, never 0 here.
    assert standby.running and standby.problem is None and standby.lag_s is None
    assert standby.position is not None and parse_lsn(standby.position) > 0
    with psycopg.connect(pg_replica.url_for(replicated_database), autocommit=True) as on_replica:
        replayed = replay_position(on_replica)
    assert replayed is not None and parse_lsn(replayed) >= parse_lsn(standby.position)


def test_paused_replay_makes_before_batch_wait_with_growing_lag_and_resume_lets_it_return(
        engine: sa.Engine, pg_replica: Replica, replicated_database: str) -> None:
    throttle = Throttle(engine, BatchSizer(100), ThrottleLimits(max_replica_lag=0.3), poll_interval=0.05)
    assert throttle.check().reason is None
    pg_replica.pause_replay()
    write_some_wal(replicated_database)
    wait_until(lambda: throttle.check().reason == REASON_LAG, "lag above max_replica_lag")
    waiter = Waiter(throttle)
    lags: list[float] = []

    def lag_grew() -> bool:
        state = throttle.last_state
        if state.replica_lag is not None:
            lags.append(state.replica_lag)
        return len(lags) > 3 and lags[-1] > lags[0] + 0.2

    wait_until(lag_grew, "growing lag while replay is paused")
    assert not waiter.returned()
    assert throttle.last_state.reason == REASON_LAG
    pg_replica.resume_replay()
    waiter.join()
    assert throttle.waited[REASON_LAG] > 0
    assert throttle.last_state.reason is None
    metrics = RotationMetrics()
    throttle.record(metrics)
    values = {s.name: s.value for f in metrics.registry.collect() for s in f.samples
              if s.labels.get("reason", REASON_LAG) == REASON_LAG}
    assert values[f"{metrics.prefix}_throttled_seconds_total"] == throttle.waited[REASON_LAG]
    assert values[f"{metrics.prefix}_batch_size"] == 100
    assert f"{metrics.prefix}_replica_lag_seconds" in values


def test_a_configured_replica_is_measured_on_its_own_connection(
        engine: sa.Engine, pg_replica: Replica, replicated_database: str) -> None:
    throttle = Throttle(engine, BatchSizer(100), ThrottleLimits(max_replica_lag=0.3),
                        replicas=[pg_replica.url_for(replicated_database)], poll_interval=0.05)
    try:
        assert throttle.check().reason is None
        pg_replica.pause_replay()
        write_some_wal(replicated_database)
        wait_until(lambda: throttle.check().reason == REASON_LAG, "lag above max_replica_lag on the replica URL")
        assert throttle.last_state.lagging is not None and "@" in throttle.last_state.lagging
        pg_replica.resume_replay()
        wait_until(lambda: throttle.check().reason is None, "no lag after resume")
    finally:
        throttle.close()


def test_a_critical_replica_lag_stops_fail_safe(engine: sa.Engine, pg_replica: Replica,
                                                replicated_database: str) -> None:
    throttle = Throttle(engine, BatchSizer(100), ThrottleLimits(max_replica_lag=0.1, critical_replica_lag=0.4),
                        poll_interval=0.05)
    throttle.check()
    pg_replica.pause_replay()
    write_some_wal(replicated_database)
    # Batches go on until the lag (counted from when the WAL was first seen) is above the limit.
    wait_until(lambda: throttle.check().reason == REASON_LAG, "lag above max_replica_lag")
    waiter = Waiter(throttle)
    waiter.thread.join(BOUND_S)
    assert isinstance(waiter.error, ThrottleCritical), (throttle.last_state, throttle.waited)
    assert "job.critical_replica_lag" in str(waiter.error)


def test_an_unreachable_replica_counts_as_lagging_and_the_stop_event_ends_the_wait(
        engine: sa.Engine, tmp_path: Any) -> None:
    throttle = Throttle(engine, BatchSizer(100), ThrottleLimits(max_replica_lag=1.0),
                        replicas=[f"postgresql://postgres@/x?host={tmp_path}"], poll_interval=0.05)
    try:
        state = throttle.check()
        assert state.reason == REASON_LAG
        assert state.replica_lag is None
        waiter = Waiter(throttle)
        wait_until(lambda: throttle.waited[REASON_LAG] > 0, "waiting for the unreachable replica")
        assert not waiter.returned()
        waiter.stop.set()
        waiter.join()
    finally:
        throttle.close()


def test_more_busy_sessions_than_max_active_sessions_make_the_drain_wait(engine: sa.Engine,
                                                                        replicated_database: str) -> None:
    sleepers = [psycopg.connect(replicated_database, autocommit=True, application_name="app") for _ in range(3)]
    threads = [threading.Thread(target=_sleep_until_cancelled, args=(c,), daemon=True) for c in sleepers]
    throttle = Throttle(engine, BatchSizer(100), ThrottleLimits(max_active_sessions=2), poll_interval=0.05)
    try:
        baseline = throttle.check()
        assert baseline.reason is None
        for t in threads:
            t.start()
        wait_until(lambda: throttle.check().reason == REASON_LOAD, "three busy application sessions")
        assert throttle.last_state.sessions is not None and throttle.last_state.sessions >= 3
        waiter = Waiter(throttle)
        wait_until(lambda: throttle.waited[REASON_LOAD] > 0, "waiting for load")
        assert not waiter.returned()
        _cancel(replicated_database, sleepers)
        waiter.join()
        assert throttle.last_state.reason is None
    finally:
        _cancel(replicated_database, sleepers)
        _join(threads)  # a connection closed while its thread is inside execute aborts the process (libpq)
        for c in sleepers:
            c.close()


def test_our_own_busy_sessions_do_not_count_as_load(engine: sa.Engine, replicated_database: str) -> None:
    ours = [psycopg.connect(replicated_database, autocommit=True, application_name="pinrotate") for _ in range(3)]
    threads = [threading.Thread(target=_sleep_until_cancelled, args=(c,), daemon=True) for c in ours]
    throttle = Throttle(engine, BatchSizer(100), ThrottleLimits(max_active_sessions=1), poll_interval=0.05)
    try:
        for t in threads:
            t.start()
        with psycopg.connect(replicated_database, autocommit=True) as probe:
            wait_until(lambda: (probe.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name ="
                                              " 'pinrotate' AND state = 'active'").fetchone() or (0,))[0] >= 3,
                       "three busy pinrotate sessions")
        state = throttle.check()
        assert state.reason is None
        assert state.sessions is not None and state.sessions <= 1
    finally:
        _cancel(replicated_database, ours)
        _join(threads)  # CI: closing one mid-execute crashed the xdist worker ("Fatal Python error: Aborted")
        for c in ours:
            c.close()


def test_an_application_session_blocked_by_our_lock_halves_the_batch_and_waits_until_it_gets_through(
        engine: sa.Engine, replicated_database: str) -> None:
    with psycopg.connect(replicated_database, autocommit=True) as setup:
        setup.execute("CREATE TABLE account (id int PRIMARY KEY, balance int)")
        setup.execute("INSERT INTO account VALUES (1, 0)")
    ours = psycopg.connect(replicated_database, autocommit=True, application_name="pinrotate")
    app = psycopg.connect(replicated_database, autocommit=True, application_name="app")
    sizer = BatchSizer(400)
    throttle = Throttle(engine, sizer, poll_interval=0.05)
    updated = threading.Event()
    try:
        ours.execute("BEGIN")
        ours.execute("SELECT * FROM account WHERE id = 1 FOR NO KEY UPDATE")

        def app_update() -> None:
            app.execute("UPDATE account SET balance = balance + 1 WHERE id = 1")
            updated.set()

        threading.Thread(target=app_update, daemon=True).start()
        wait_until(lambda: throttle.check().reason == REASON_LOCKS, "the application session blocked by us")
        assert throttle.last_state.blocked == 1
        waiter = Waiter(throttle)
        wait_until(lambda: throttle.waited[REASON_LOCKS] > 0, "waiting for the blocked session")
        assert sizer.size == 200
        assert not waiter.returned() and not updated.is_set()
        ours.execute("COMMIT")
        waiter.join()
        assert updated.wait(BOUND_S)
    finally:
        ours.close()
        app.close()


def test_a_lock_held_by_another_application_session_is_not_our_business(engine: sa.Engine,
                                                                          replicated_database: str) -> None:
    with psycopg.connect(replicated_database, autocommit=True) as setup:
        setup.execute("CREATE TABLE account (id int PRIMARY KEY, balance int)")
        setup.execute("INSERT INTO account VALUES (1, 0)")
    holder = psycopg.connect(replicated_database, autocommit=True, application_name="app-a")
    app = psycopg.connect(replicated_database, autocommit=True, application_name="app-b")
    throttle = Throttle(engine, BatchSizer(400), poll_interval=0.05)
    try:
        holder.execute("BEGIN")
        holder.execute("SELECT * FROM account WHERE id = 1 FOR UPDATE")
        blocked = threading.Thread(target=app.execute, args=("UPDATE account SET balance = 1 WHERE id = 1",),
                                   daemon=True)
        blocked.start()
        with psycopg.connect(replicated_database, autocommit=True) as probe:
            wait_until(lambda: (probe.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'app-b'"
                                              " AND wait_event_type = 'Lock'").fetchone() or (0,))[0] == 1,
                       "app-b blocked by app-a")
        state = throttle.check()
        assert state.reason is None and state.blocked == 0
        holder.execute("COMMIT")
        blocked.join(BOUND_S)
    finally:
        holder.close()
        app.close()


def test_a_pause_from_the_operator_waits_until_lifted_and_its_delay_and_batch_size_apply(
        engine: sa.Engine) -> None:
    value: dict[str, Any] = {"paused": True}
    throttle = Throttle(engine, BatchSizer(100), control=lambda: dict(value), poll_interval=0.05)
    waiter = Waiter(throttle)
    wait_until(lambda: throttle.waited[REASON_PAUSED] > 0, "waiting while paused")
    assert not waiter.returned()
    value.clear()
    value.update({"batch_size": 321, "delay": 0.0})
    waiter.join()
    assert throttle.batch_size == 321
    value.clear()
    throttle.check()
    assert throttle.batch_size == 100


def test_an_invalid_operator_value_pauses_fail_safe(engine: sa.Engine) -> None:
    throttle = Throttle(engine, BatchSizer(100), control=lambda: {"paused": "no"}, poll_interval=0.05)
    state = throttle.check()
    assert state.reason == REASON_PAUSED
    assert state.control.invalid == "paused: Input should be a valid boolean"


def test_a_deadline_ends_the_wait(engine: sa.Engine) -> None:
    throttle = Throttle(engine, BatchSizer(100), control=lambda: {"paused": True}, poll_interval=0.05)
    waiter = Waiter(throttle, deadline=time.monotonic() + 0.3)
    waiter.join()
    assert throttle.waited[REASON_PAUSED] > 0


# -- only signals that are ours (issue 23, point 7) --------------------------------------------


def test_a_session_waiting_on_our_single_instance_advisory_lock_is_not_held_up_by_a_batch(
        engine: sa.Engine, replicated_database: str) -> None:
    ours = psycopg.connect(replicated_database, autocommit=True, application_name="pinrotate")
    app = psycopg.connect(replicated_database, autocommit=True, application_name="app")
    sizer = BatchSizer(400)
    throttle = Throttle(engine, sizer, poll_interval=0.05, tables=["account"])
    try:
        ours.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (LOCK_NAME,))
        waiting = threading.Thread(target=app.execute, daemon=True,
                                   args=("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (LOCK_NAME,)))
        waiting.start()
        with psycopg.connect(replicated_database, autocommit=True) as probe:
            wait_until(lambda: (probe.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'app'"
                                              " AND wait_event = 'advisory'").fetchone() or (0,))[0] == 1,
                       "the application session waiting on the advisory lock")
        state = throttle.check()
        assert state.reason is None and state.blocked == 0
        waiter = Waiter(throttle)
        waiter.join()
        assert sizer.size == 400 and throttle.waited[REASON_LOCKS] == 0
        ours.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (LOCK_NAME,))
        waiting.join(BOUND_S)
    finally:
        ours.close()
        app.close()


def test_a_row_lock_wait_counts_only_on_a_drained_table(engine: sa.Engine, replicated_database: str) -> None:
    with psycopg.connect(replicated_database, autocommit=True) as setup:
        setup.execute("CREATE SCHEMA ledger")
        for table in ("ledger.account", "audit"):
            setup.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, n int)")
            setup.execute(f"INSERT INTO {table} VALUES (1, 0)")
    ours = psycopg.connect(replicated_database, autocommit=True, application_name="pinrotate")
    app = psycopg.connect(replicated_database, autocommit=True, application_name="app")
    throttle = Throttle(engine, BatchSizer(400), poll_interval=0.05, tables=["ledger.account"])
    try:
        for table, counts in (("audit", 0), ("ledger.account", 1)):
            ours.execute("BEGIN")
            ours.execute(f"SELECT * FROM {table} WHERE id = 1 FOR NO KEY UPDATE")
            update = threading.Thread(target=app.execute, args=(f"UPDATE {table} SET n = n + 1 WHERE id = 1",),
                                      daemon=True)
            update.start()
            with psycopg.connect(replicated_database, autocommit=True) as probe:
                wait_until(lambda: (probe.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name ="
                                                  " 'app' AND wait_event_type = 'Lock'").fetchone() or (0,))[0] == 1,
                           f"the application session waiting for a row of {table}")
            state = throttle.check()
            assert state.blocked == counts, table
            assert state.reason == (REASON_LOCKS if counts else None)
            ours.execute("COMMIT")
            update.join(BOUND_S)
    finally:
        ours.close()
        app.close()


def test_a_wait_for_locks_backs_off_instead_of_looking_every_20_ms(engine: sa.Engine,
                                                                   replicated_database: str) -> None:
    with psycopg.connect(replicated_database, autocommit=True) as setup:
        setup.execute("CREATE TABLE account (id int PRIMARY KEY, n int)")
        setup.execute("INSERT INTO account VALUES (1, 0)")
    ours = psycopg.connect(replicated_database, autocommit=True, application_name="pinrotate")
    app = psycopg.connect(replicated_database, autocommit=True, application_name="app")
    looks = [0]

    def control() -> None:  # asked once per look
        looks[0] += 1

    throttle = Throttle(engine, BatchSizer(400), control=control, tables=["account"])
    try:
        ours.execute("BEGIN")
        ours.execute("SELECT * FROM account WHERE id = 1 FOR NO KEY UPDATE")
        threading.Thread(target=app.execute, args=("UPDATE account SET n = 1 WHERE id = 1",), daemon=True).start()
        wait_until(lambda: throttle.check().reason == REASON_LOCKS, "the application session blocked by us")
        waiter = Waiter(throttle)
        wait_until(lambda: throttle.waited[REASON_LOCKS] > 4.0, "four seconds of waiting for locks")
        assert not waiter.returned()
        # At one look per 20 ms that would be 200 looks; backing off to one per second, about a dozen.
        assert looks[0] < 4.0 / LOCKS_POLL_INTERVAL / 5, looks[0]
        ours.execute("COMMIT")
        waiter.join()
    finally:
        ours.close()
        app.close()


def test_pg_receivewal_is_not_a_standby_and_max_replica_lag_does_not_wait_for_it(
        engine: sa.Engine, pg_replica: Replica, replicated_database: str, tmp_path: Any) -> None:
    with wal_receiver(pg_replica.primary_admin_url, tmp_path / "wal") as receiver:
        write_some_wal(replicated_database)
        pg_replica.wait_caught_up()
        throttle = Throttle(engine, BatchSizer(100), ThrottleLimits(max_replica_lag=0.3), poll_interval=0.05)
        wait_until(lambda: throttle.check().reason is None, "no lag with the standby caught up")
        assert throttle.lag_meter is not None
        with engine.connect() as sa_conn:
            conn = sa_conn.connection.driver_connection
            assert isinstance(conn, psycopg.Connection)
            lags = throttle.lag_meter.measure(conn)
        assert lags and not any(name.startswith(receiver) for name in lags)  # the standby only
        assert throttle.lag_meter.problems() == {}
        Waiter(throttle).join()


def test_pg_recvlogical_is_not_a_standby_and_max_replica_lag_does_not_wait_for_it() -> None:
    with logical_decoding() as url:
        engine = make_engine(url, pool_size=1)
        try:
            throttle = Throttle(engine, BatchSizer(100), ThrottleLimits(max_replica_lag=0.3), poll_interval=0.05)
            state = throttle.check()
            assert state.reason is None and state.replica_lag == 0.0  # no standby at all
            assert throttle.lag_meter is not None and throttle.lag_meter.problems() == {}
        finally:
            engine.dispose()


# -- every wait honours the run's limits (issue 23, point 11) -------------------------------------


def test_the_operator_control_is_bounded_and_documented_as_a_strict_model() -> None:
    schema = OperatorControl.model_json_schema()
    assert schema["additionalProperties"] is False
    assert schema["properties"]["batch_size"]["anyOf"][0]["maximum"] == MAX_BATCH_SIZE
    assert schema["properties"]["delay"]["anyOf"][0]["maximum"] == MAX_DELAY
    assert parse_control({"delay": MAX_DELAY, "batch_size": MAX_BATCH_SIZE}) == ThrottleControl(
        batch_size=MAX_BATCH_SIZE, delay=MAX_DELAY)


def test_a_long_operator_delay_ends_as_soon_as_the_operator_clears_it(engine: sa.Engine) -> None:
    value: dict[str, Any] = {"delay": MAX_DELAY}
    reads = [0]

    def control() -> dict[str, Any]:
        reads[0] += 1
        return dict(value)

    throttle = Throttle(engine, BatchSizer(100), control=control, poll_interval=0.05)
    waiter = Waiter(throttle)  # not the first batch: the operator's delay is due
    wait_until(lambda: reads[0] >= 3, "the control re-read during the delay")
    assert not waiter.returned()
    value.clear()
    waiter.join()  # within a slice, not after an hour


def test_a_refused_operator_value_pauses_and_deleting_it_resumes(engine: sa.Engine) -> None:
    value: list[Any] = [{"delay": 1e308}]
    throttle = Throttle(engine, BatchSizer(100), control=lambda: value[0], poll_interval=0.05)
    waiter = Waiter(throttle)
    wait_until(lambda: throttle.waited[REASON_PAUSED] > 0, "paused fail-safe on a delay beyond its bound")
    assert throttle.last_state.control.invalid == "delay: Input should be less than or equal to 3600"
    value[0] = None  # the Variable deleted
    waiter.join()


def test_the_pause_between_batches_ends_at_the_run_deadline(engine: sa.Engine) -> None:
    throttle = Throttle(engine, BatchSizer(100), delay=600.0, poll_interval=0.05)
    throttle.check()
    Waiter(throttle, deadline=time.monotonic() + 0.3).join()  # bounded by BOUND_S, far below 600 s


def _sleep_until_cancelled(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.execute("SELECT pg_sleep(600)")
    except psycopg.errors.QueryCanceled:
        pass
    except psycopg.OperationalError:
        pass


def _join(threads: list[threading.Thread]) -> None:
    """Wait for the sleepers to leave ``execute`` (cancelled) before their connections are closed."""
    for t in threads:
        if t.is_alive():
            t.join(timeout=30)


def _cancel(url: str, conns: list[psycopg.Connection[Any]]) -> None:
    with psycopg.connect(url, autocommit=True) as admin:
        for c in conns:
            if not c.closed:
                admin.execute("SELECT pg_cancel_backend(%s)", (c.info.backend_pid,))
