"""``fpc1`` (compare-and-swap) writes and the rows an application holds locked, on a real PostgreSQL.

A compare-and-swap batch locks its rows ``FOR NO KEY UPDATE SKIP LOCKED`` in the write itself: a
row an application transaction holds is skipped (never waited on, never a CONFLICT), left on its
old key for the sweep or the next run, and counted in the backlog left; every other row moves. An
edit the application makes while it holds the row is never overwritten: the row is read again
after the application commits, and its value (the application's) is what moves.

The application is a second connection with a transaction open; nothing is timed: the per-batch
``lock_timeout`` is short, so that a drain that waited on the application would stop with
``db_error`` instead of finishing. tests/test_drain_cas_locks_mysql.py runs the ``assert_*`` bodies
on MariaDB.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.drain import BatchEvent, DrainResult
from pinrotate_core.rotation import retire_gate  # by the URL's engine, as the command line asks it
from pinrotate_core.schemes.fpc1_values import parse_fpc1

from .test_fpc1_migration import K1, K2, decrypt, fpc1, write_keys

ROWS = 19
LOCKED = (2, 3, 11)  # ids the application holds; 2 and 3 share a batch with unlocked rows
BATCH = 4


def plain(row_id: int) -> bytes:
    return f"test password {row_id}".encode()


Execute = Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]
IN_LOCKED = f"IN ({', '.join(['%s'] * len(LOCKED))})"


@dataclass
class LockedCreds:
    """``creds`` (ROWS values under k1) in a fresh database of one engine, and an application
    session whose open transaction holds LOCKED (FOR UPDATE, as an edit screen would);
    tests/test_drain_cas_locks_mysql.py makes the MariaDB one."""

    url: str
    execute: Execute  # the test's own session (autocommit)
    app: Execute  # the application's session, inside its transaction


def create_creds(execute: Execute) -> None:
    execute("CREATE TABLE creds (id bigint PRIMARY KEY, pw text)", ())
    rows = [(i, fpc1("k1", K1, plain(i))) for i in range(1, ROWS + 1)]
    execute("INSERT INTO creds VALUES " + ", ".join(["(%s, %s)"] * len(rows)), tuple(x for r in rows for x in r))


def hold_locked(app: Execute) -> None:
    app("BEGIN", ())
    app(f"SELECT id FROM creds WHERE id {IN_LOCKED} FOR UPDATE", LOCKED)


def pg_execute(conn: psycopg.Connection[Any]) -> Execute:
    def execute(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        cur = conn.execute(statement, params)
        return list(cur.fetchall()) if cur.description else []

    return execute


@pytest.fixture
def locked(database_url: str, pg_conn: psycopg.Connection[Any]) -> Iterator[LockedCreds]:
    create_creds(pg_execute(pg_conn))
    conn = psycopg.connect(database_url, autocommit=True, application_name="app")
    try:
        hold_locked(pg_execute(conn))
        yield LockedCreds(database_url, pg_execute(pg_conn), pg_execute(conn))
    finally:
        conn.close()


def settings(database_url: str, keys_file: Path) -> Settings:
    return settings_from_mapping({
        "database": {"url": database_url},
        "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": BATCH, "inter_batch_delay": 0, "lock_timeout": 0.2},
        # A run's gate also answers for `legacy` (fpc1 migrates legacy values): nothing is on it, so it
        # would open, and settling it waits [gate] wait for the application's transaction, in flight
        # since before the gate read, to end. Its default, 60 s, only made the test wait: the verdicts
        # asserted here come from the counts, and an unsettled `legacy` answers closed either way.
        "gate": {"wait": 1},
        "targets": [{"name": "T", "format": "fpc1", "table": "creds", "columns": ["pw"]}],
    }, env={})


def drain(s: Settings, on_batch: Callable[[BatchEvent], None] | None = None) -> DrainResult:
    """One drain of T by the URL's engine (batch_size BATCH, lock_timeout 0.2 s: ``settings``), one worker."""
    ctx = rotation.open_run(s, target_names=["T"], expected_key="k2")
    try:
        rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        return rotation.drain(ctx, "T", workers=1, on_batch=on_batch)
    finally:
        ctx.close()


def key_of(execute: Execute) -> dict[int, str]:
    return {int(r[0]): parse_fpc1(str(r[1])).key_id for r in execute("SELECT id, pw FROM creds", ())}


def assert_locked_rows_are_skipped_and_the_others_move_without_waiting(db: LockedCreds, keys_file: Path) -> None:
    write_keys(keys_file)
    before = {int(r[0]): str(r[1]) for r in db.execute("SELECT id, pw FROM creds", ())}

    result = drain(settings(db.url, keys_file))

    # Not stopped by lock_timeout: every unlocked row moved, the locked ones were skipped.
    assert result.stopped is None and result.error is None, result.error
    assert result.reencrypted == ROWS - len(LOCKED)
    assert result.conflicts == 0 and not result.failed and not result.fail_closed
    assert result.backlog_remaining == len(LOCKED)  # left, and reported as left
    keys = key_of(db.execute)
    assert {i for i, k in keys.items() if k == "k1"} == set(LOCKED)
    assert all(str(r[1]) == before[int(r[0])]
               for r in db.execute(f"SELECT id, pw FROM creds WHERE id {IN_LOCKED}", LOCKED))
    for row in db.execute("SELECT id, pw FROM creds", ()):
        assert decrypt(str(row[1])) == plain(int(row[0]))
    db.app("COMMIT", ())

    # Once the application let go, the next run moves them.
    again = drain(settings(db.url, keys_file))
    assert again.reencrypted == len(LOCKED) and again.backlog_remaining == 0 and again.conflicts == 0
    assert set(key_of(db.execute).values()) == {"k2"}


def test_rows_an_application_holds_locked_are_skipped_and_left_the_others_move_without_waiting(
        locked: LockedCreds, keys_file: Path) -> None:
    assert_locked_rows_are_skipped_and_the_others_move_without_waiting(locked, keys_file)


def assert_an_edit_made_while_the_row_was_locked_is_not_overwritten(db: LockedCreds, keys_file: Path) -> None:
    write_keys(keys_file)
    # The application edits two of its locked rows (one with a stale keyring: under k1) and commits
    # once the pass has written its last batch (nothing is read ahead any more): the sweep reads
    # the rows again.
    stale_app_value = fpc1("k1", K1, b"typed by the user, old keyring")
    fresh_app_value = fpc1("k2", K2, b"typed by the user")
    db.app("UPDATE creds SET pw = %s WHERE id = 2", (stale_app_value,))
    db.app("UPDATE creds SET pw = %s WHERE id = 11", (fresh_app_value,))
    committed: list[int] = []

    last_batch = -(-ROWS // BATCH)

    def application_commits_after_the_pass(event: BatchEvent) -> None:
        if not committed and event.batch == last_batch:
            db.app("COMMIT", ())
            committed.append(event.batch)

    result = drain(settings(db.url, keys_file), on_batch=application_commits_after_the_pass)

    assert committed == [last_batch]
    assert result.stopped is None and result.conflicts == 0 and not result.fail_closed
    # The sweep read the rows again after the commit: the application's k1 value moved (its
    # plaintext kept), its k2 value was left alone, row 3 (locked, unedited) moved too.
    assert result.backlog_remaining == 0
    assert result.reencrypted == ROWS - 1  # every row but 11, which the application put on k2 itself
    row = {int(r[0]): str(r[1]) for r in db.execute("SELECT id, pw FROM creds", ())}
    assert parse_fpc1(row[2]).key_id == "k2" and decrypt(row[2]) == b"typed by the user, old keyring"
    assert row[11] == fresh_app_value
    assert decrypt(row[3]) == plain(3) and parse_fpc1(row[3]).key_id == "k2"
    assert rotation.inventory(settings(db.url, keys_file)).targets["T"].counts["CONFLICT"] == 0


def test_an_edit_made_while_the_row_was_locked_is_not_overwritten_and_moves_once_committed(
        locked: LockedCreds, keys_file: Path) -> None:
    assert_an_edit_made_while_the_row_was_locked_is_not_overwritten(locked, keys_file)


def assert_a_row_locked_for_the_whole_run_closes_the_gate_for_its_key(db: LockedCreds, keys_file: Path) -> None:
    write_keys(keys_file)
    s = settings(db.url, keys_file)
    report = rotation.run_rotation(s, expected_key="k2")
    assert report.exit_code == rotation.EXIT_OK
    assert report.targets["T"].backlog_remaining == len(LOCKED) and report.targets["T"].conflicts == 0
    assert not report.gate["k1"]["open"]  # three values still on k1
    db.app("ROLLBACK", ())
    assert rotation.run_rotation(s, expected_key="k2").exit_code == rotation.EXIT_OK
    assert retire_gate(s, "k1").open


def test_a_row_locked_for_the_whole_run_closes_the_gate_for_its_key_and_is_no_conflict(
        locked: LockedCreds, keys_file: Path) -> None:
    assert_a_row_locked_for_the_whole_run_closes_the_gate_for_its_key(locked, keys_file)
