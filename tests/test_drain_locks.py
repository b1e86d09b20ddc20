"""What a drain's locks cost the application, observed on a real PostgreSQL (``aesgcm``: the
row-version write guard).

- A batch is read without locks: while it is re-encrypted (or the process is frozen) no pinrotate
  transaction is open and none of its rows is locked; an application's edit of one of them then
  goes through at once and is kept (the write misses that row version; the sweep moves the edit).
- A row the application holds locked at the write is waited on only briefly, then the batch is
  written again skipping it: the other rows commit, the row is left for the next run, the
  application's transaction is untouched, even with a ``lock_timeout`` far above the test's bound.
- ``lock_timeout`` and ``statement_timeout`` bound every statement: a batch that waits on a table
  lock fails after that long with a clean ``db_error`` stop and writes nothing.
- Waits between batches hold nothing: with a throttle the next batch is still read while this one
  is re-encrypted (the pipeline is on), and a paused drain holds nothing open.

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
from pinrotate_core.drain.counting import BacklogCounter
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
    """pinrotate sessions on this test's database in a transaction that has locked or written rows
    (it holds a transaction id). Only this database's: other tests (xdist workers, other sessions)
    drain other databases of the same shared server meanwhile."""
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pinrotate'"
                       " AND datname = current_database() AND backend_xid IS NOT NULL").fetchone()
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


def test_while_a_batch_is_reencrypted_none_of_its_rows_is_locked_and_an_edit_then_is_kept(pin: PinDb) -> None:
    pin.conn.execute("CREATE TABLE profile.person_notes (id serial PRIMARY KEY,"
                     " person_id uuid NOT NULL REFERENCES profile.persons (id))")
    app = psycopg.connect(pin.url, autocommit=True, application_name="app")
    seen: list[Any] = []
    edited: list[Any] = []

    def application_works_on_the_batch(batch: int, ids: Sequence[Any]) -> None:
        if batch != 1 or edited:  # the pass's first batch only (the sweep's batches count from 1 too)
            return
        # Batch 1 is read and being re-encrypted (a frozen process would be here): no pinrotate
        # transaction holds anything, so the application locks and edits a row of it at once ...
        seen.append(our_open_transactions(app))
        app.execute("BEGIN")
        app.execute("SET LOCAL lock_timeout = '100ms'")
        seen.append(len(app.execute("SELECT 1 FROM profile.persons WHERE id = %s FOR UPDATE NOWAIT",
                                    (ids[0],)).fetchall()))
        app.execute("UPDATE profile.persons SET version = version + 1 WHERE id = %s", (ids[0],))
        app.execute("INSERT INTO profile.person_notes (person_id) VALUES (%s)", (ids[1],))
        app.execute("COMMIT")
        edited.append(ids[0])

    before = dict(pin.conn.execute("SELECT id, version FROM profile.persons").fetchall())
    try:
        result = drain_person(pin.settings(), application_works_on_the_batch)
    finally:
        app.close()
    assert seen == [0, 1]
    # ... and its edit is kept: the drain's write missed that row (not the version it read), the
    # sweep read it again, with the application's edit, and moved it.
    assert result.stopped is None and result.reencrypted == PERSONS and result.backlog_remaining == 0
    assert on_key_2(pin) == PERSONS
    after = dict(pin.conn.execute("SELECT id, version FROM profile.persons").fetchall())
    assert after[edited[0]] == before[edited[0]] + 1
    assert all(after[i] == v for i, v in before.items() if i != edited[0])
    notes = pin.conn.execute("SELECT count(*) FROM profile.person_notes").fetchone()
    assert notes is not None and notes[0] == 1


def test_a_row_the_application_holds_locked_is_skipped_after_a_short_wait_and_the_batch_still_commits(
        pin: PinDb, log_lines: list[str]) -> None:
    app = psycopg.connect(pin.url, autocommit=True, application_name="app")
    held: list[Any] = []

    def application_holds_a_row(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1 and not held:  # held for the whole run, as an edit screen left open would
            app.execute("BEGIN")
            app.execute("SELECT 1 FROM profile.persons WHERE id = %s FOR UPDATE", (ids[0],))
            held.append(ids[0])

    try:
        # lock_timeout far above the test's bound: a drain that waited it out would never finish here.
        result = drain_person(pin.settings(), application_holds_a_row, lock_timeout=BOUND_S * 10)
        # The application's transaction is intact: its edit of the row goes through and is kept.
        app.execute("UPDATE profile.persons SET version = version + 1 WHERE id = %s", (held[0],))
        app.execute("COMMIT")
    finally:
        app.close()
    assert result.stopped is None
    assert result.reencrypted == PERSONS - 1 and result.backlog_remaining == 1
    assert on_key_2(pin) == PERSONS - 1
    row = pin.conn.execute("SELECT key_version FROM profile.persons WHERE id = %s", (held[0],)).fetchone()
    assert row is not None and row[0] == 1
    assert any("event=batch_write_retried" in line for line in log_lines)
    # Released: the next run moves it.
    again = drain_person(pin.settings())
    assert again.reencrypted == 1 and on_key_2(pin) == PERSONS


@pytest.mark.parametrize(("timeouts", "sqlstate"), [
    ({"lock_timeout": 0.2, "statement_timeout": 30.0}, "55P03"),  # LockNotAvailable
    ({"lock_timeout": 30.0, "statement_timeout": 0.3}, "57014"),  # QueryCanceled
], ids=["lock_timeout", "statement_timeout"])
def test_a_batch_blocked_by_a_table_lock_fails_after_the_per_batch_timeout_and_writes_nothing(
        pin: PinDb, timeouts: dict[str, float], sqlstate: str) -> None:
    admin = psycopg.connect(pin.url, autocommit=True, application_name="app-ddl")
    probe = psycopg.connect(pin.url, autocommit=True)
    errors: list[BaseException] = []

    def cautious_writes_waiting() -> int:
        # Batch 1's second try (its first waits on the table for at most a short while): the lock of
        # its rows, SKIP LOCKED. The drain's last count of the backlog queues behind the lock too.
        row = probe.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pinrotate'"
                            " AND datname = current_database()"
                            " AND wait_event_type = 'Lock' AND query LIKE '%SKIP LOCKED%'").fetchone()
        return int(row[0]) if row else 0

    def release_once_the_batch_gave_up() -> None:
        try:
            wait_until(lambda: cautious_writes_waiting() > 0, "batch 1 waiting on the table lock")
            wait_until(lambda: cautious_writes_waiting() == 0, "batch 1 giving up")
            admin.execute("COMMIT")
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)
            admin.execute("ROLLBACK")

    releaser = threading.Thread(target=release_once_the_batch_gave_up, daemon=True)

    def ddl_arrives(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:  # batch 1 is read: its write now queues behind an ACCESS EXCLUSIVE lock
            admin.execute("BEGIN")
            admin.execute("LOCK TABLE profile.persons IN ACCESS EXCLUSIVE MODE")
            releaser.start()

    try:
        result = drain_person(pin.settings(), ddl_arrives, **timeouts)
        releaser.join(BOUND_S)
    finally:
        admin.close()
        probe.close()
    assert not errors, errors
    assert result.stopped == STOP_DB_ERROR and result.fail_closed and result.retryable
    assert result.error is not None and f"SQLSTATE {sqlstate}" in result.error
    # Batch 1 wrote nothing, and nothing after it ran.
    assert result.reencrypted == 0
    assert on_key_2(pin) == 0
    assert result.backlog_remaining == PERSONS


class CountingThrottle(Throttle):
    """A throttle that counts the reader's calls: one before every batch is read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def before_batch(self, *args: Any, **kwargs: Any) -> None:
        super().before_batch(*args, **kwargs)
        self.calls += 1


def test_with_a_throttle_the_next_batch_is_read_while_this_one_is_reencrypted(pin: PinDb) -> None:
    throttles: list[CountingThrottle] = []
    calls_at_batch_1: list[int] = []

    def look(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            wait_until(lambda: throttles[0].calls >= 2, "batch 2 read ahead of batch 1's write")
            calls_at_batch_1.append(throttles[0].calls)

    def make_throttle(ctx: rotation.RunContext) -> Throttle:
        throttles.append(CountingThrottle(ctx.engine, BatchSizer(BATCH)))
        return throttles[0]

    result = drain_person(pin.settings(), look, throttle=make_throttle)
    assert calls_at_batch_1 and calls_at_batch_1[0] >= 2
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


def test_a_connection_lost_in_the_count_after_the_pass_is_a_retryable_db_error_stop(
        pin: PinDb, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real loss: the server ends the session of the count after the pass (as pg_terminate_backend
    # from an operator, or a restart, would). It must stop the target like a failed batch (a result,
    # fail-closed and retryable), never escape as a bare driver error; the batches stay committed.
    count_left = BacklogCounter.count_left

    def count_on_a_session_the_server_ends(self: BacklogCounter, conn: psycopg.Connection[Any],
                                           failed: frozenset[str]) -> tuple[int, int]:
        conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return count_left(self, conn, failed)

    monkeypatch.setattr(BacklogCounter, "count_left", count_on_a_session_the_server_ends)
    result = drain_person(pin.settings())
    assert result.stopped == STOP_DB_ERROR and result.fail_closed and result.retryable
    assert result.error is not None and "SQLSTATE 57P01" in result.error, result.error
    assert result.reencrypted == PERSONS and on_key_2(pin) == PERSONS
    assert result.backlog_remaining == 0  # recounted on a new connection
