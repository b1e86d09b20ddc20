"""What a drain's locks cost the application, observed on a real PostgreSQL.

- Rows are locked ``FOR NO KEY UPDATE``: a child-table insert whose foreign key points at a row of
  the open batch goes through at once (it takes ``FOR KEY SHARE``), while a ``FOR UPDATE`` of the
  same row, taken at the same moment, does wait (so the row really is locked then).
- ``lock_timeout`` and ``statement_timeout`` are set per batch transaction: a batch that waits on a
  table lock fails after that long with a clean ``db_error`` stop, the batches before it stay, and
  it writes nothing. A batch transaction left idle longer than ``batch_idle_timeout`` is ended by
  the server (its rows are freed) and writes nothing.
- Waits between batches hold no transaction: with a throttle the next batch is still locked while
  this one is re-encrypted (the pipeline is on), and a paused drain holds nothing open.

Nothing is timed: every wait polls for a state, with a bound against a hang only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import Settings
from pinrotate_core.drain import STOP_DB_ERROR, Drain, DrainOptions, DrainResult
from pinrotate_core.throttle import BatchSizer, Throttle

from .test_drain_pin import PinDb

PERSONS = 300
BATCH = 100
BOUND_S = 60.0  # only a bound against a hang; never asserted on


@pytest.fixture
def pin(database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, tmp_path: Path) -> Iterator[PinDb]:
    db = PinDb(database_url, pg_conn, keys_file, tmp_path)
    db.seed(PERSONS)
    db.make_key_2_current()
    yield db


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.02)


def on_key_2(db: PinDb) -> int:
    row = db.conn.execute("SELECT count(*) FROM profile.persons WHERE key_version = 2").fetchone()
    return int(row[0]) if row else 0


def our_open_transactions(conn: psycopg.Connection[Any]) -> int:
    """pinrotate sessions in a transaction that has locked or written rows (it holds a transaction id)."""
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pinrotate'"
                       " AND backend_xid IS NOT NULL").fetchone()
    return int(row[0]) if row else 0


def drain_person(settings: Settings, hook: Callable[[int, Sequence[Any]], None] | None = None,
                 throttle: Callable[[rotation.RunContext], Throttle] | None = None, **options: Any) -> DrainResult:
    """The Person target's drain through the run's own steps, with ``hook`` between read and write."""
    ctx = rotation.open_run(settings, target_names=["Person"])
    try:
        rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        opts = DrainOptions(batch_size=BATCH, run_id=ctx.run_id, before_write=hook,
                            throttle=throttle(ctx) if throttle is not None else None, **options)
        return Drain(ctx.engine, ctx.schemes["Person"], opts).run()
    finally:
        ctx.close()


def test_a_child_insert_with_a_foreign_key_to_a_row_of_the_open_batch_does_not_wait(pin: PinDb) -> None:
    pin.conn.execute("CREATE TABLE profile.person_notes (id serial PRIMARY KEY,"
                     " person_id uuid NOT NULL REFERENCES profile.persons (id))")
    app = psycopg.connect(pin.url, autocommit=True, application_name="app")
    other = psycopg.connect(pin.url, autocommit=True, application_name="app-other")
    seen: list[str] = []

    def application_inserts_a_note(batch: int, ids: Sequence[Any]) -> None:
        if batch != 1:
            return
        # The row is locked by the open batch now: a FOR UPDATE of it times out ...
        other.execute("BEGIN")
        other.execute("SET LOCAL lock_timeout = '100ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            other.execute("SELECT 1 FROM profile.persons WHERE id = %s FOR UPDATE", (ids[0],))
        other.execute("ROLLBACK")
        seen.append("locked")
        # ... and yet the application's child insert (FOR KEY SHARE on the parent) goes through.
        app.execute("BEGIN")
        app.execute("SET LOCAL lock_timeout = '100ms'")
        app.execute("INSERT INTO profile.person_notes (person_id) VALUES (%s)", (ids[0],))
        app.execute("COMMIT")
        seen.append("inserted")

    try:
        result = drain_person(pin.settings(), application_inserts_a_note)
    finally:
        app.close()
        other.close()
    assert seen == ["locked", "inserted"]
    assert result.stopped is None and result.reencrypted == PERSONS
    assert on_key_2(pin) == PERSONS
    notes = pin.conn.execute("SELECT count(*) FROM profile.person_notes").fetchone()
    assert notes is not None and notes[0] == 1


@pytest.mark.parametrize(("timeouts", "sqlstate"), [
    ({"lock_timeout": 0.2, "statement_timeout": 30.0}, "55P03"),  # LockNotAvailable
    ({"lock_timeout": 30.0, "statement_timeout": 0.3}, "57014"),  # QueryCanceled
], ids=["lock_timeout", "statement_timeout"])
def test_a_batch_blocked_by_a_table_lock_fails_after_the_per_batch_timeout_and_writes_nothing(
        pin: PinDb, timeouts: dict[str, float], sqlstate: str) -> None:
    admin = psycopg.connect(pin.url, autocommit=True, application_name="app-ddl")
    probe = psycopg.connect(pin.url, autocommit=True)
    lock_taken = threading.Event()
    errors: list[BaseException] = []

    def batches_waiting_on_a_lock() -> int:
        # A batch's read only: the drain's last count of the backlog queues behind the lock too.
        row = probe.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pinrotate'"
                            " AND wait_event_type = 'Lock' AND query LIKE '%FOR NO KEY UPDATE%'").fetchone()
        return int(row[0]) if row else 0

    def take_the_table() -> None:
        # Queued behind batches 1 and 2; batch 3 then queues behind it and gives up after its
        # timeout; release once it has, so that the drain's last count can read the table.
        try:
            admin.execute("BEGIN")
            admin.execute("LOCK TABLE profile.persons IN ACCESS EXCLUSIVE MODE")
            lock_taken.set()
            wait_until(lambda: batches_waiting_on_a_lock() > 0, "batch 3 waiting on the table lock")
            wait_until(lambda: batches_waiting_on_a_lock() == 0, "batch 3 giving up")
            admin.execute("COMMIT")
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)
            admin.execute("ROLLBACK")

    taker = threading.Thread(target=take_the_table, daemon=True)

    def ddl_arrives(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            # Batch 2 is read and locked ahead while batch 1 is worked: the LOCK queues behind both.
            wait_until(lambda: our_open_transactions(probe) >= 2, "batch 2 locked ahead")
            taker.start()
            wait_until(lambda: (probe.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name ="
                                              " 'app-ddl' AND wait_event_type = 'Lock'").fetchone() or (0,))[0] == 1,
                       "the LOCK TABLE queued")

    try:
        result = drain_person(pin.settings(), ddl_arrives, **timeouts)
        taker.join(BOUND_S)
    finally:
        admin.close()
        probe.close()
    assert not errors, errors
    assert lock_taken.is_set()
    assert result.stopped == STOP_DB_ERROR and result.fail_closed and result.retryable
    assert result.error is not None and f"SQLSTATE {sqlstate}" in result.error
    # Batches 1 and 2 committed whole; batch 3 wrote nothing.
    assert result.reencrypted == 2 * BATCH
    assert on_key_2(pin) == 2 * BATCH
    assert result.backlog_remaining == PERSONS - 2 * BATCH


def test_a_batch_left_idle_past_batch_idle_timeout_is_ended_by_the_server_and_writes_nothing(pin: PinDb) -> None:
    probe = psycopg.connect(pin.url, autocommit=True)
    held: list[int] = []

    def process_freezes(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            held.append(our_open_transactions(probe))
            # A frozen process: the server ends the idle batch transactions and frees their rows.
            wait_until(lambda: our_open_transactions(probe) == 0, "the idle batches ended by the server")
            held.append(len(probe.execute("SELECT id FROM profile.persons WHERE id = %s FOR UPDATE NOWAIT",
                                          (ids[0],)).fetchall()))

    try:
        result = drain_person(pin.settings(), process_freezes, idle_timeout=0.5)
    finally:
        probe.close()
    assert held[0] >= 1 and held[1] == 1  # was held, then free for anyone
    assert result.stopped == STOP_DB_ERROR and result.fail_closed and result.retryable
    assert result.error is not None and "SQLSTATE 25P03" in result.error, result.error
    assert result.reencrypted == 0
    assert on_key_2(pin) == 0


def test_with_a_throttle_the_next_batch_is_locked_while_this_one_is_reencrypted(pin: PinDb) -> None:
    probe = psycopg.connect(pin.url, autocommit=True)
    open_at_batch_1: list[int] = []

    def look(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            wait_until(lambda: our_open_transactions(probe) >= 2, "batch 2 locked ahead of batch 1's write")
            open_at_batch_1.append(our_open_transactions(probe))

    try:
        result = drain_person(pin.settings(), look, throttle=lambda ctx: Throttle(ctx.engine, BatchSizer(BATCH)))
    finally:
        probe.close()
    assert open_at_batch_1 and open_at_batch_1[0] >= 2
    assert result.stopped is None and result.reencrypted == PERSONS


def test_a_paused_drain_holds_no_transaction_and_no_row_while_it_waits(pin: PinDb) -> None:
    probe = psycopg.connect(pin.url, autocommit=True)
    control: dict[str, Any] = {}
    throttles: list[Throttle] = []
    result: list[DrainResult] = []

    def pause_after_batch_1(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            control["paused"] = True

    def make_throttle(ctx: rotation.RunContext) -> Throttle:
        # A fresh look before every batch (check_interval=0): the pause applies from batch 3 on.
        throttles.append(Throttle(ctx.engine, BatchSizer(BATCH), control=lambda: dict(control), poll_interval=0.05,
                                  check_interval=0.0))
        return throttles[0]

    thread = threading.Thread(target=lambda: result.append(drain_person(pin.settings(), pause_after_batch_1,
                                                                       throttle=make_throttle)), daemon=True)
    thread.start()
    try:
        wait_until(lambda: bool(throttles) and throttles[0].waited["paused"] > 0
                   and our_open_transactions(probe) == 0, "the drain paused, its last batch committed")
        assert thread.is_alive()
        assert throttles[0].state()["status"] == "paused"
        moved = on_key_2(pin)
        assert BATCH <= moved < PERSONS  # batch 1 (and batch 2 if it was locked ahead before the pause)
        # No row of the rest is locked: all of them can be locked at once, without waiting.
        row = probe.execute("SELECT count(*) FROM (SELECT 1 FROM profile.persons WHERE key_version = 1"
                            " FOR UPDATE NOWAIT) AS rest").fetchone()
        assert row is not None and row[0] == PERSONS - moved
        assert on_key_2(pin) == moved
    finally:
        control.clear()
        probe.close()
    thread.join(BOUND_S)
    assert not thread.is_alive()
    assert result[0].stopped is None and result[0].reencrypted == PERSONS


def test_without_a_throttle_the_inter_batch_delay_ends_at_the_deadline(pin: PinDb) -> None:
    # Nothing throttles this drain: its plain inter_batch_delay (600 s, far past BOUND_S) is the wait
    # between batches, and that wait ends at the deadline, holding nothing, rather than after 600 s.
    stop = threading.Event()
    result: list[DrainResult] = []
    thread = threading.Thread(target=lambda: result.append(drain_person(
        pin.settings(), inter_batch_delay=600.0, deadline=time.monotonic() + 1.5, stop=stop)), daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        stop.set()  # let the drain go before the test fails
        thread.join(BOUND_S)
        raise AssertionError("the wait between batches did not end at the deadline")
    assert result[0].stopped == "deadline"
    assert result[0].batches <= 1  # the delay was kept until the deadline: at most the first batch ran
    assert on_key_2(pin) == result[0].reencrypted < PERSONS
