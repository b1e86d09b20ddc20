"""The row-version write guard (``aesgcm``) on every table layout, on a real PostgreSQL.

A plain table's rows are written back by their ``ctid`` (one heap fetch); a partitioned table and
a table with inheritance children by their id (a ``ctid`` is only unique within one heap). On each,
every row moves with its plaintext unchanged, and an application's edit made between a batch's read
and its write is kept: a change of another column, and a new value written under the old key (the
drain's write misses both; the sweep reads them again and moves the application's value), and so
is an edit the application commits while the drain's write waits for that row.
Keys are random TEST keys made here.
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
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.db import raw_connection
from pinrotate_core.drain import Drain, DrainOptions, DrainResult
from pinrotate_core.drain.guard_version import VersionGuard
from pinrotate_core.keyring import Keyring
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.targets import resolve_target

ROWS = 40
BATCH = 8
LAYOUTS = ("plain", "partitioned", "inherited")


def create(conn: psycopg.Connection[Any], layout: str, keyring: Keyring) -> None:
    columns = "id bigint PRIMARY KEY, key_version integer NOT NULL, name_cipher bytea, note text"
    if layout == "partitioned":
        conn.execute(f"CREATE TABLE people ({columns}) PARTITION BY RANGE (id)")
        conn.execute("CREATE TABLE people_low PARTITION OF people FOR VALUES FROM (0) TO (20)")
        conn.execute("CREATE TABLE people_high PARTITION OF people FOR VALUES FROM (20) TO (1000)")
    else:
        conn.execute(f"CREATE TABLE people ({columns})")
    if layout == "inherited":
        conn.execute("CREATE TABLE people_archived () INHERITS (people)")
    ciphers = AesGcmCipherSet(keyring)
    for i in range(1, ROWS + 1):
        table = "people_archived" if layout == "inherited" and i % 3 == 0 else "people"
        conn.execute(f"INSERT INTO {table} (id, key_version, name_cipher) VALUES (%s, 1, %s)",
                     (i, ciphers.encrypt_current(f"TEST name {i}".encode())))


def people_on_key_1(conn: psycopg.Connection[Any], layout: str, keys_file: Path) -> Keyring:
    """``people`` on key 1, then key 2 made current: the keyring with both."""
    provider = FileKeyProvider(keys_file, create=True)
    create(conn, layout, provider.load_keyring())
    provider.add_key()
    provider.promote("2")
    return provider.load_keyring()


def settings(url: str, keys_file: Path) -> Settings:
    return settings_from_mapping({
        "database": {"url": url},
        "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": BATCH, "inter_batch_delay": 0},
        "targets": [{"name": "People", "table": "people", "key_version": "key_version", "columns": ["name_cipher"]}],
    }, env={})


def drain(s: Settings, hook: Any = None) -> tuple[DrainResult, bool]:
    ctx = rotation.open_run(s, target_names=["People"])
    try:
        rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        scheme = ctx.schemes["People"]
        opts = DrainOptions(batch_size=BATCH, run_id=ctx.run_id, before_write=hook)
        return Drain(ctx.engine, scheme, opts).run(), scheme.target.by_ctid
    finally:
        ctx.close()


def names(conn: psycopg.Connection[Any], keyring: Keyring) -> dict[int, tuple[int, str, str | None]]:
    ciphers = AesGcmCipherSet(keyring)
    return {int(i): (int(kv), ciphers.cipher(str(kv)).decrypt(bytes(blob)).decode(), note)
            for i, kv, blob, note in conn.execute("SELECT id, key_version, name_cipher, note FROM people")}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_row_moves_and_edits_made_between_read_and_write_are_kept(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, layout: str) -> None:
    keyring = people_on_key_1(pg_conn, layout, keys_file)
    app = psycopg.connect(database_url, autocommit=True, application_name="app")
    edits: list[Any] = []

    def application_edits(batch: int, ids: Sequence[Any]) -> None:
        if batch == 2 and not edits:  # batch 2 of the first pass: read, not yet written
            edits.extend(ids[:2])
            app.execute("UPDATE people SET note = 'TEST edited' WHERE id = %s", (ids[0],))
            # An application still writing with the old key: its value, not the one read, must move.
            old = AesGcmCipherSet(Keyring(current="1", keys=keyring.keys, source="test"))
            app.execute("UPDATE people SET name_cipher = %s WHERE id = %s",
                        (old.encrypt_current(b"TEST renamed"), ids[1]))

    try:
        result, by_ctid = drain(settings(database_url, keys_file), application_edits)
    finally:
        app.close()
    assert by_ctid is (layout == "plain")
    assert result.stopped is None and result.reencrypted == ROWS and result.backlog_remaining == 0
    after = names(pg_conn, keyring)
    assert {kv for kv, _, _ in after.values()} == {2}
    edited, renamed = edits
    assert after[edited] == (2, f"TEST name {edited}", "TEST edited")
    assert after[renamed] == (2, "TEST renamed", None)
    assert all(after[i] == (2, f"TEST name {i}", None) for i in after if i not in edits)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_catalog_says_which_tables_are_written_by_ctid(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, layout: str) -> None:
    provider = FileKeyProvider(keys_file, create=True)
    create(pg_conn, layout, provider.load_keyring())
    s = settings(database_url, keys_file)
    ctx = rotation.open_run(s, target_names=["People"])
    try:
        with raw_connection(ctx.engine) as conn:
            assert resolve_target(conn, s.targets[0], writing=False).by_ctid is (layout == "plain")
    finally:
        ctx.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_edit_committed_while_the_write_waits_for_its_row_is_kept(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, layout: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The write waits for the application's row as long as it takes here (no second try), so the
    # application's COMMIT lands in the middle of the drain's UPDATE: PostgreSQL re-checks the row's
    # newest version against the version read, which it is not.
    monkeypatch.setattr(VersionGuard, "row_wait", 60.0)
    keyring = people_on_key_1(pg_conn, layout, keys_file)
    app = psycopg.connect(database_url, autocommit=True, application_name="app")
    probe = psycopg.connect(database_url, autocommit=True)
    edits: list[Any] = []
    errors: list[BaseException] = []

    def commit_once_the_drain_waits() -> None:
        try:
            deadline = time.monotonic() + 60
            # This database's sessions only: other tests drain other databases of a shared server.
            while not (probe.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pinrotate'"
                                     " AND datname = current_database() AND wait_event_type = 'Lock'")
                       .fetchone() or (0,))[0]:
                assert time.monotonic() < deadline, "the drain's write never waited for the row"
                time.sleep(0.02)
            app.execute("COMMIT")
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    committer = threading.Thread(target=commit_once_the_drain_waits, daemon=True)

    def application_edits(batch: int, ids: Sequence[Any]) -> None:
        if batch == 2 and not edits:
            edits.append(ids[3])
            old = AesGcmCipherSet(Keyring(current="1", keys=keyring.keys, source="test"))
            app.execute("BEGIN")
            app.execute("UPDATE people SET name_cipher = %s, note = 'TEST edited' WHERE id = %s",
                        (old.encrypt_current(b"TEST renamed"), ids[3]))
            committer.start()

    try:
        result, _ = drain(settings(database_url, keys_file), application_edits)
        committer.join(60)
    finally:
        app.close()
        probe.close()
    assert not errors, errors
    assert result.stopped is None and result.reencrypted == ROWS and result.backlog_remaining == 0
    after = names(pg_conn, keyring)
    assert after[edits[0]] == (2, "TEST renamed", "TEST edited")
    assert all(after[i] == (2, f"TEST name {i}", None) for i in after if i not in edits)


def test_a_table_rewritten_between_read_and_write_gives_no_row_another_rows_value(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    # Every row inserted by one transaction (one xmin), then CLUSTER, which rewrites the table in
    # another order keeping each row's xmin: after it, the ctid a row was read at may hold another
    # row with the same xmin. The write also checks the id, so it misses those rows instead of
    # writing one row's value into another; the sweep reads them again.
    provider = FileKeyProvider(keys_file, create=True)
    ciphers = AesGcmCipherSet(provider.load_keyring())
    pg_conn.execute("CREATE TABLE people (id bigint PRIMARY KEY, key_version integer NOT NULL,"
                    " name_cipher bytea, note text)")
    with pg_conn.transaction():
        pg_conn.cursor().executemany("INSERT INTO people (id, key_version, name_cipher) VALUES (%s, 1, %s)",
                                     [(i, ciphers.encrypt_current(f"TEST name {i}".encode()))
                                      for i in range(1, ROWS + 1)])
    pg_conn.execute("CREATE INDEX people_backwards ON people (id DESC)")
    assert pg_conn.execute("SELECT count(DISTINCT xmin::text) FROM people").fetchone() == (1,)
    provider.add_key()
    provider.promote("2")
    keyring = provider.load_keyring()
    admin = psycopg.connect(database_url, autocommit=True)
    rewritten: list[bool] = []

    def table_rewritten(batch: int, ids: Sequence[Any]) -> None:
        if batch == 2 and not rewritten:  # batch 1 written, batch 2 read: now its ctids move
            admin.execute("CLUSTER people USING people_backwards")
            rewritten.append(True)

    try:
        result, by_ctid = drain(settings(database_url, keys_file), table_rewritten)
    finally:
        admin.close()
    assert by_ctid
    assert result.stopped is None and result.reencrypted == ROWS and result.backlog_remaining == 0
    assert names(pg_conn, keyring) == {i: (2, f"TEST name {i}", None) for i in range(1, ROWS + 1)}
