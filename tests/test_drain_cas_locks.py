"""``fpc1`` (compare-and-swap) writes and the rows an application holds locked, on a real PostgreSQL.

A compare-and-swap batch locks its rows ``FOR NO KEY UPDATE SKIP LOCKED`` in the write itself: a
row an application transaction holds is skipped (never waited on, never a CONFLICT), left on its
old key for the sweep or the next run, and counted in the backlog left; every other row moves. An
edit the application makes while it holds the row is never overwritten: the row is read again
after the application commits, and its value (the application's) is what moves.

The application is a second connection with a transaction open; nothing is timed: the per-batch
``lock_timeout`` is short, so that a drain that waited on the application would stop with
``db_error`` instead of finishing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.drain import BatchEvent, Drain, DrainOptions, DrainResult
from pinrotate_core.gate import retire_gate
from pinrotate_core.schemes.fpc1_values import parse_fpc1

from .test_fpc1_migration import K1, K2, decrypt, fpc1, write_keys

ROWS = 19
LOCKED = (2, 3, 11)  # ids the application holds; 2 and 3 share a batch with unlocked rows
BATCH = 4


def plain(row_id: int) -> bytes:
    return f"test password {row_id}".encode()


@pytest.fixture
def creds(pg_conn: psycopg.Connection[Any]) -> None:
    pg_conn.execute("CREATE TABLE creds (id bigint PRIMARY KEY, pw text)")
    pg_conn.cursor().executemany("INSERT INTO creds VALUES (%s, %s)",
                                 [(i, fpc1("k1", K1, plain(i))) for i in range(1, ROWS + 1)])


@pytest.fixture
def app(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """The application: a transaction holding row locks on LOCKED (FOR UPDATE, as an edit screen would)."""
    conn = psycopg.connect(database_url, autocommit=True, application_name="app")
    conn.execute("BEGIN")
    conn.execute("SELECT id FROM creds WHERE id = ANY(%s) FOR UPDATE", (list(LOCKED),))
    try:
        yield conn
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


def drain(s: Settings, **options: Any) -> DrainResult:
    ctx = rotation.open_run(s, target_names=["T"], expected_key="k2")
    try:
        rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        opts = DrainOptions(batch_size=BATCH, run_id=ctx.run_id, lock_timeout=0.2, **options)
        return Drain(ctx.engine, ctx.schemes["T"], opts).run()
    finally:
        ctx.close()


def key_of(conn: psycopg.Connection[Any]) -> dict[int, str]:
    return {int(r[0]): parse_fpc1(str(r[1])).key_id for r in conn.execute("SELECT id, pw FROM creds")}


def test_rows_an_application_holds_locked_are_skipped_and_left_the_others_move_without_waiting(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, creds: None,
        app: psycopg.Connection[Any]) -> None:
    write_keys(keys_file)
    before = {int(r[0]): str(r[1]) for r in pg_conn.execute("SELECT id, pw FROM creds")}

    result = drain(settings(database_url, keys_file))

    # Not stopped by lock_timeout: every unlocked row moved, the locked ones were skipped.
    assert result.stopped is None and result.error is None, result.error
    assert result.reencrypted == ROWS - len(LOCKED)
    assert result.conflicts == 0 and not result.failed and not result.fail_closed
    assert result.backlog_remaining == len(LOCKED)  # left, and reported as left
    keys = key_of(pg_conn)
    assert {i for i, k in keys.items() if k == "k1"} == set(LOCKED)
    assert all(str(r[1]) == before[int(r[0])]
               for r in pg_conn.execute("SELECT id, pw FROM creds WHERE id = ANY(%s)", (list(LOCKED),)))
    for row in pg_conn.execute("SELECT id, pw FROM creds"):
        assert decrypt(str(row[1])) == plain(int(row[0]))
    app.execute("COMMIT")

    # Once the application let go, the next run moves them.
    again = drain(settings(database_url, keys_file))
    assert again.reencrypted == len(LOCKED) and again.backlog_remaining == 0 and again.conflicts == 0
    assert set(key_of(pg_conn).values()) == {"k2"}


def test_an_edit_made_while_the_row_was_locked_is_not_overwritten_and_moves_once_committed(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, creds: None,
        app: psycopg.Connection[Any]) -> None:
    write_keys(keys_file)
    # The application edits two of its locked rows (one with a stale keyring: under k1) and commits
    # once the pass has written its last batch (nothing is read ahead any more): the sweep reads
    # the rows again.
    stale_app_value = fpc1("k1", K1, b"typed by the user, old keyring")
    fresh_app_value = fpc1("k2", K2, b"typed by the user")
    app.execute("UPDATE creds SET pw = %s WHERE id = 2", (stale_app_value,))
    app.execute("UPDATE creds SET pw = %s WHERE id = 11", (fresh_app_value,))
    committed: list[int] = []

    last_batch = -(-ROWS // BATCH)

    def application_commits_after_the_pass(event: BatchEvent) -> None:
        if not committed and event.batch == last_batch:
            app.execute("COMMIT")
            committed.append(event.batch)

    result = drain(settings(database_url, keys_file), on_batch=application_commits_after_the_pass)

    assert committed == [last_batch]
    assert result.stopped is None and result.conflicts == 0 and not result.fail_closed
    # The sweep read the rows again after the commit: the application's k1 value moved (its
    # plaintext kept), its k2 value was left alone, row 3 (locked, unedited) moved too.
    assert result.backlog_remaining == 0
    assert result.reencrypted == ROWS - 1  # every row but 11, which the application put on k2 itself
    row = {int(r[0]): str(r[1]) for r in pg_conn.execute("SELECT id, pw FROM creds")}
    assert parse_fpc1(row[2]).key_id == "k2" and decrypt(row[2]) == b"typed by the user, old keyring"
    assert row[11] == fresh_app_value
    assert decrypt(row[3]) == plain(3) and parse_fpc1(row[3]).key_id == "k2"
    assert rotation.inventory(settings(database_url, keys_file)).targets["T"].counts["CONFLICT"] == 0


def test_a_row_locked_for_the_whole_run_closes_the_gate_for_its_key_and_is_no_conflict(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, creds: None,
        app: psycopg.Connection[Any]) -> None:
    write_keys(keys_file)
    s = settings(database_url, keys_file)
    report = rotation.run_rotation(s, expected_key="k2")
    assert report.exit_code == rotation.EXIT_OK
    assert report.targets["T"].backlog_remaining == len(LOCKED) and report.targets["T"].conflicts == 0
    assert not report.gate["k1"]["open"]  # three values still on k1
    app.execute("ROLLBACK")
    assert rotation.run_rotation(s, expected_key="k2").exit_code == rotation.EXIT_OK
    assert retire_gate(s, "k1").open
