"""Lock races the application wins, on a real PostgreSQL: each leaves a row for the sweep (or the
next run), never stops the target. A serialization failure (the application commits a partition-key
move of a row the drain's write waits for; a database whose default isolation is REPEATABLE READ),
and a foreign key's FOR KEY SHARE lock on a row whose cipher column has a unique index (the drain's
UPDATE is then a key update). Every row is decrypted afterwards. Keys are random TEST keys made here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.drain.guard_version import VersionGuard
from pinrotate_core.schemes.fpc1_values import parse_fpc1

from .test_drain_versions import ROWS, drain, names, people_on_key_1, settings
from .test_fpc1_migration import DC, Forge, decrypt, forge_settings, write_keys


def commit_once_the_drain_waits(database_url: str, app: psycopg.Connection[Any], errors: list[BaseException]) -> None:
    """Commit ``app``'s open transaction once the drain's write waits for a lock."""
    try:
        with psycopg.connect(database_url, autocommit=True) as probe:
            deadline = time.monotonic() + 60
            while not (probe.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pinrotate'"
                                     " AND wait_event_type = 'Lock'").fetchone() or (0,))[0]:
                assert time.monotonic() < deadline, "the drain's write never waited for the row"
                time.sleep(0.02)
        app.execute("COMMIT")
    except BaseException as e:  # noqa: BLE001 - handed to the test thread
        errors.append(e)


@pytest.mark.parametrize("race", ["repeatable_read_default", "partition_key_move"])
def test_an_application_commit_during_the_row_wait_skips_the_row_and_the_target_goes_on(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, race: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The write waits for the application's row until it commits (no short wait here), so the
    # commit lands in the middle of the drain's UPDATE.
    monkeypatch.setattr(VersionGuard, "row_wait", 60.0)
    layout = "partitioned" if race == "partition_key_move" else "plain"
    keyring = people_on_key_1(pg_conn, layout, keys_file)
    if race == "repeatable_read_default":
        dbname = pg_conn.info.dbname
        pg_conn.execute(f"ALTER DATABASE {dbname} SET default_transaction_isolation = 'repeatable read'")
    app = psycopg.connect(database_url, autocommit=True, application_name="app")
    errors: list[BaseException] = []
    committer = threading.Thread(target=commit_once_the_drain_waits, args=(database_url, app, errors), daemon=True)
    edited: list[int] = []

    def application_edits(batch: int, ids: Sequence[Any]) -> None:
        if batch == 2 and not edited:
            row = ids[3]
            edited.append(row)
            app.execute("BEGIN")
            if race == "partition_key_move":  # people_low (ids below 20) to people_high
                app.execute("UPDATE people SET id = id + 500 WHERE id = %s", (row,))
            else:
                app.execute("UPDATE people SET note = 'TEST edited' WHERE id = %s", (row,))
            committer.start()

    try:
        result, _ = drain(settings(database_url, keys_file), application_edits)
        committer.join(60)
    finally:
        app.close()
    assert not errors, errors
    assert result.stopped is None and result.error is None, result.error
    after = names(pg_conn, keyring)
    row = edited[0]
    moved = row + 500 if race == "partition_key_move" else row
    assert after[moved][1] == f"TEST name {row}"
    assert {kv for kv, _, _ in after.values()} == {2} and result.backlog_remaining == 0
    assert all(after[i][1] == f"TEST name {i}" for i in after if i != moved)


def test_a_foreign_keys_key_share_lock_on_a_row_with_a_unique_cipher_column_skips_that_row(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    keyring = people_on_key_1(pg_conn, "plain", keys_file)
    pg_conn.execute("CREATE UNIQUE INDEX people_name_once ON people (name_cipher)")
    pg_conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY, person_id bigint NOT NULL REFERENCES people)")
    app = psycopg.connect(database_url, autocommit=True, application_name="app")
    try:
        app.execute("BEGIN")  # an order being placed for person 5: FOR KEY SHARE on that row until it commits
        app.execute("INSERT INTO orders VALUES (1, 5)")
        result, _ = drain(settings(database_url, keys_file))
        app.execute("COMMIT")
    finally:
        app.close()
    assert result.stopped is None and result.error is None, result.error
    assert result.reencrypted == ROWS - 1 and result.backlog_remaining == 1
    after = names(pg_conn, keyring)
    assert after[5] == (1, "TEST name 5", None)
    assert all(after[i] == (2, f"TEST name {i}", None) for i in after if i != 5)


def test_fpc1_a_foreign_keys_key_share_lock_on_a_row_with_a_unique_cipher_column_skips_that_row(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    # The compare-and-swap guard locks its rows itself, never waiting: FOR UPDATE SKIP LOCKED
    # where its UPDATE is a key update, so the application's FOR KEY SHARE skips the row.
    forge = Forge(pg_conn)
    write_keys(keys_file)
    pg_conn.execute("CREATE UNIQUE INDEX data_connections_password_once ON data_connections (password)")
    pg_conn.execute("CREATE TABLE connection_uses (id bigint PRIMARY KEY,"
                    " connection_id bigint NOT NULL REFERENCES data_connections)")
    before = forge.password(4)
    app = psycopg.connect(database_url, autocommit=True, application_name="app")
    try:
        app.execute("BEGIN")  # a use of connection 4 being recorded: FOR KEY SHARE on it until it commits
        app.execute("INSERT INTO connection_uses VALUES (1, 4)")
        report = rotation.run_rotation(forge_settings(database_url, keys_file), target_names=[DC], expected_key="k2")
        app.execute("COMMIT")
    finally:
        app.close()
    result = report.targets[DC]
    assert result.stopped is None and result.error is None, result.error
    assert forge.password(4) == before and result.backlog_remaining == 1 and result.conflicts == 0
    for row_id in (1, 2, 7):
        value = forge.password(row_id)
        assert value is not None and parse_fpc1(value).key_id == "k2"
        assert decrypt(value) == forge.plain[("dc", row_id, "password")]
