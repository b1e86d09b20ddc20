"""End to end: a real drain that shares the database. With replay paused on a real streaming replica
the drain stops writing, and after resume it finishes; a Prefect Variable set to paused stops a
running drain between batches, and clearing it lets the run finish.

"Stops writing" is observed, not timed: the rows on the new key are counted until the count holds
still over several polls, and must then be short of the whole table.
"""

from __future__ import annotations

import contextvars
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import settings_from_mapping
from pinrotate_core.errors import ConfigError

from .pg_replica import Replica, pg_replica, replicated_database  # noqa: F401
from .test_drain_pin import PinDb

# xdist: every test of this module on one worker (one streaming replica of the worker's embedded server for the module).
pytestmark = pytest.mark.xdist_group("test_throttle_drain")

PERSONS = 3000
BOUND_S = 120.0  # only a bound against a hang; never asserted on
STILL_POLLS = 4  # the count must hold still over this many polls ...
POLL_S = 0.5  # ... this far apart (the drain's throttle looks every 0.5 s at most)


@pytest.fixture
def pin(replicated_database: str, keys_file: Path, tmp_path: Path) -> Iterator[PinDb]:
    conn = psycopg.connect(replicated_database, autocommit=True)
    try:
        db = PinDb(replicated_database, conn, keys_file, tmp_path)
        db.seed(PERSONS)
        db.make_key_2_current()
        yield db
    finally:
        conn.close()


def on_new_key(db: PinDb) -> int:
    row = db.conn.execute("SELECT count(*) FROM profile.persons WHERE key_version = 2").fetchone()
    return int(row[0]) if row else 0


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.05)


def wait_until_still(db: PinDb) -> int:
    """The count of rows on the new key once it has held still over STILL_POLLS polls."""
    counts: list[int] = []

    def still() -> bool:
        counts.append(on_new_key(db))
        time.sleep(POLL_S)
        return len(counts) >= STILL_POLLS and len(set(counts[-STILL_POLLS:])) == 1

    wait_until(still, "the drain stopped writing")
    return counts[-1]


class Run:
    """``run_rotation`` over the Person target in a thread."""

    def __init__(self, db: PinDb, control: Callable[[], Any] | None = None, **job: Any) -> None:
        settings = db.settings(**{"batch_size": 20, "inter_batch_delay": 0.02, **job})
        self.report: rotation.RunReport | None = None
        self.error: BaseException | None = None
        self.stop = threading.Event()
        # In a copy of the test's context, as Prefect's task threads are: its settings reach the run.
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run, settings, control),
                                       daemon=True)
        self.thread.start()

    def _run(self, settings: Any, control: Callable[[], Any] | None) -> None:
        try:
            self.report = rotation.run_rotation(settings, target_names=["Person"], stop=self.stop,
                                                throttle_control=control)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e

    def finish(self) -> rotation.RunReport:
        self.thread.join(BOUND_S)
        if self.thread.is_alive():
            self.stop.set()
            self.thread.join(BOUND_S)
            raise AssertionError("the run did not finish")
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report


def test_with_replay_paused_on_the_replica_the_drain_stops_writing_and_finishes_after_resume(
        pin: PinDb, pg_replica: Replica, log_lines: list[str]) -> None:
    pg_replica.pause_replay()
    run = Run(pin, max_replica_lag=0.3)
    try:
        wait_until(lambda: on_new_key(pin) > 0, "the first batches")
        held = wait_until_still(pin)
        assert 0 < held < PERSONS
        assert run.thread.is_alive()
        assert any("event=throttle_waiting" in line and "reason=lag" in line for line in log_lines)
    finally:
        pg_replica.resume_replay()
    report = run.finish()
    assert report.exit_code == rotation.EXIT_OK
    assert report.targets["Person"].reencrypted == PERSONS
    assert report.targets["Person"].backlog_remaining == 0
    assert on_new_key(pin) == PERSONS
    assert any("event=throttle_resumed" in line and "after=lag" in line for line in log_lines)


def test_a_critical_replica_lag_stops_the_run_fail_safe_with_exit_4(pin: PinDb, pg_replica: Replica) -> None:
    pg_replica.pause_replay()
    try:
        report = Run(pin, max_replica_lag=0.2, critical_replica_lag=0.6).finish()
    finally:
        pg_replica.resume_replay()
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED
    person = report.targets["Person"]
    assert person.stopped == "throttle_critical"
    assert person.error is not None and "job.critical_replica_lag" in person.error
    assert 0 < on_new_key(pin) < PERSONS  # what committed before the stop stays


def test_a_prefect_variable_set_to_paused_stops_a_running_drain_and_clearing_it_resumes(
        pin: PinDb, prefect_api: str) -> None:
    from prefect.variables import Variable

    from flows.throttle import VariableThrottleControl

    name = f"pinrotate_throttle_{uuid.uuid4().hex[:8]}"
    control = VariableThrottleControl(name, ttl=0.2)
    assert control() is None  # no Variable: no say
    # 150 batches at least 0.1 s apart (15 s or more): the drain cannot end before the pause set
    # through the Prefect API reaches it, however slow that API is under a parallel test run.
    run = Run(pin, control=control, inter_batch_delay=0.1)
    try:
        wait_until(lambda: on_new_key(pin) > 0, "the first batches")
        Variable.set(name, {"paused": True}, overwrite=True)
        held = wait_until_still(pin)
        assert 0 < held < PERSONS
        assert run.thread.is_alive()
        Variable.set(name, {}, overwrite=True)
    finally:
        Variable.unset(name)
    report = run.finish()
    assert report.exit_code == rotation.EXIT_OK
    assert on_new_key(pin) == PERSONS


def test_the_variable_reader_caches_reads_in_the_background_and_keeps_the_last_value_when_the_api_is_unreachable(
        prefect_api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.variables import Variable

    from flows.throttle import VariableThrottleControl

    name = f"pinrotate_throttle_{uuid.uuid4().hex[:8]}"
    now = [0.0]
    control = VariableThrottleControl(name, ttl=5.0, clock=lambda: now[0])
    Variable.set(name, {"paused": True, "batch_size": 50}, overwrite=True)
    try:
        assert control.refresh() == {"paused": True, "batch_size": 50}
        Variable.set(name, {}, overwrite=True)
        now[0] = 1.0
        assert control() == {"paused": True, "batch_size": 50}  # cached for ttl seconds
        control.wait_for_read()
        assert control() == {"paused": True, "batch_size": 50}  # and no read was started
        now[0] = 6.0
        # Past the ttl, a call still answers at once with the last value, and starts one read.
        assert control() == {"paused": True, "batch_size": 50}
        control.wait_for_read()
        assert control() == {}
        Variable.set(name, {"paused": True}, overwrite=True)
        # A Prefect API that cannot be reached: the last value read stays in force.
        with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
            now[0] = 12.0
            assert control() == {}
            control.wait_for_read()
            assert control() == {}
    finally:
        Variable.unset(name)


def test_an_application_session_waiting_on_the_single_instance_lock_does_not_stall_the_run(
        pin: PinDb, log_lines: list[str]) -> None:
    app = psycopg.connect(pin.url, autocommit=True, application_name="app")
    run = Run(pin, control=lambda: None, single_instance=True)
    try:
        wait_until(lambda: on_new_key(pin) > 0, "the first batches (the run holds its lock)")
        waiting = threading.Thread(target=app.execute, daemon=True,
                                   args=("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (rotation.LOCK_NAME,)))
        waiting.start()
        wait_until(lambda: (pin.conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'app'"
                                             " AND wait_event = 'advisory'").fetchone() or (0,))[0] == 1
                   or not run.thread.is_alive(), "the application session waiting on the run's lock")
        report = run.finish()
        assert report.exit_code == rotation.EXIT_OK
        assert on_new_key(pin) == PERSONS
        assert not any("event=throttle_backoff" in line for line in log_lines)
        waiting.join(BOUND_S)  # the run's end freed the lock
    finally:
        app.close()


def test_a_variable_delay_beyond_its_bound_pauses_and_deleting_the_variable_resumes(
        pin: PinDb, prefect_api: str, log_lines: list[str]) -> None:
    from prefect.variables import Variable

    from flows.throttle import VariableThrottleControl

    name = f"pinrotate_throttle_{uuid.uuid4().hex[:8]}"
    run = Run(pin, control=VariableThrottleControl(name, ttl=0.2))
    try:
        wait_until(lambda: on_new_key(pin) > 0, "the first batches")
        # 1e9 s, far past MAX_DELAY (1e308 is tests/test_throttle.py's: a Prefect server on PostgreSQL
        # keeps JSON numbers as numeric and cannot give that one back, which the Variable then fails).
        Variable.set(name, {"delay": 1e9}, overwrite=True)
        held = wait_until_still(pin)
        assert 0 < held < PERSONS
        assert any("event=throttle_control_invalid" in line and "delay" in line for line in log_lines)
    finally:
        Variable.unset(name)
    report = run.finish()
    assert report.exit_code == rotation.EXIT_OK
    assert on_new_key(pin) == PERSONS


def test_an_inter_batch_delay_longer_than_the_run_ends_at_max_run_duration(pin: PinDb) -> None:
    report = Run(pin, control=lambda: None, inter_batch_delay=600, max_run_duration=3).finish()  # BOUND_S < 600
    assert report.exit_code == rotation.EXIT_OK
    assert report.targets["Person"].stopped == "deadline"
    assert 0 < on_new_key(pin) < PERSONS


def test_the_largest_batch_timeouts_postgresql_accepts_are_accepted_and_applied(pin: PinDb) -> None:
    largest = 2_147_483.647  # 2^31 - 1 ms
    report = Run(pin, control=lambda: None, lock_timeout=largest, statement_timeout=largest,
                 batch_idle_timeout=largest).finish()
    assert report.exit_code == rotation.EXIT_OK
    assert on_new_key(pin) == PERSONS


@pytest.mark.parametrize("setting", ["lock_timeout", "statement_timeout", "batch_idle_timeout"])
@pytest.mark.parametrize("seconds", [0.0004, 2_147_483.648, 1e12])
def test_a_batch_timeout_postgresql_would_read_as_none_or_refuse_is_refused_at_start(
        pin: PinDb, setting: str, seconds: float) -> None:
    with pytest.raises(ConfigError, match=f"job.{setting}"):
        settings_from_mapping(pin.raw_settings(**{setting: seconds}), env={})


def test_asking_for_the_variable_never_waits_on_an_api_that_does_not_answer(prefect_api: str) -> None:
    """A listening socket that never answers: a drain's call returns at once, the read stays behind."""
    import socket

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.throttle import VariableThrottleControl

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/api"
        control = VariableThrottleControl(f"pinrotate_throttle_{uuid.uuid4().hex[:8]}", ttl=0.0)
        with temporary_settings({PREFECT_API_URL: url}):
            answers = [control() for _ in range(50)]
            reader = control._reader
    assert answers == [None] * 50
    # The 50 calls were answered while the one read they started was still waiting on the socket.
    assert reader is not None and reader.is_alive(), "the calls waited for the read"
