"""Inherited and partitioned tables under the row-version guard (``aesgcm``), on a real PostgreSQL:
a row is identified by its table and its row version (``tableoid``, ``ctid``, ``xmin``), never by
its id alone. A parent's primary key does not cover its inheritance children, so a child's rows may
repeat the parent's ids; inserted in one transaction they share an ``xmin`` too. With a FAILED row
(a value that does not decrypt) in the batch, the write has fewer rows than the read: every other
row must still receive its own value, never its namesake's. Every row is decrypted afterwards.
Keys are random TEST keys made here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.drain import Drain, DrainOptions, DrainResult
from pinrotate_core.errors import TargetBlocked
from pinrotate_core.keyring import Keyring
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.targets import resolve_target

ROWS = 12
BATCH = 5  # odd: batches end between the two rows of one id
BROKEN = 4  # the parent's row 4 holds a value that does not decrypt: FAILED, left as it is


def settings(url: str, keys_file: Path, fmt: str = "aesgcm") -> Settings:
    return settings_from_mapping({
        "database": {"url": url},
        "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": BATCH, "inter_batch_delay": 0},
        "targets": [{"name": "People", "table": "people", "key_version": "key_version", "columns": ["name_cipher"],
                     "format": fmt}],
    }, env={})


def drain(s: Settings, hook: Any = None) -> DrainResult:
    ctx = rotation.open_run(s, target_names=["People"])
    try:
        rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        options = DrainOptions(batch_size=BATCH, run_id=ctx.run_id, before_write=hook)
        return Drain(ctx.engine, ctx.schemes["People"], options).run()
    finally:
        ctx.close()


def people_on_key_1(conn: psycopg.Connection[Any], keys_file: Path, layout: str) -> Keyring:
    """Parent and child rows (or two partitions) inserted in one transaction: one shared xmin."""
    provider = FileKeyProvider(keys_file, create=True)
    ciphers = AesGcmCipherSet(provider.load_keyring())
    columns = "id bigint PRIMARY KEY, key_version integer NOT NULL, name_cipher bytea"
    if layout == "partitioned":
        conn.execute(f"CREATE TABLE people ({columns}) PARTITION BY RANGE (id)")
        conn.execute("CREATE TABLE people_live PARTITION OF people FOR VALUES FROM (0) TO (100)")
        conn.execute("CREATE TABLE people_archive PARTITION OF people FOR VALUES FROM (100) TO (1000)")
        rows = [("people", i, f"TEST live {i}") for i in range(1, ROWS + 1)]
        rows += [("people", 100 + i, f"TEST archived {100 + i}") for i in range(1, ROWS + 1)]
    else:
        conn.execute(f"CREATE TABLE people ({columns})")
        conn.execute("CREATE TABLE people_archive () INHERITS (people)")  # no key of its own: ids repeat
        rows = [("people", i, f"TEST live {i}") for i in range(1, ROWS + 1)]
        rows += [("people_archive", i, f"TEST archived {i}") for i in range(1, ROWS + 1)]
    with conn.transaction():
        for table, i, name in rows:
            value = b"TEST not a ciphertext" if (table, i) == ("people", BROKEN) else ciphers.encrypt_current(
                name.encode())
            conn.execute(f"INSERT INTO {table} (id, key_version, name_cipher) VALUES (%s, 1, %s)", (i, value))
    assert conn.execute("SELECT count(DISTINCT xmin::text) FROM people").fetchone() == (1,)
    provider.add_key()
    provider.promote("2")
    return provider.load_keyring()


def every_row(conn: psycopg.Connection[Any], keyring: Keyring) -> dict[tuple[str, int], tuple[int, str]]:
    """(table, id) -> (key version, plaintext) of every row, decrypted with the key it names."""
    ciphers = AesGcmCipherSet(keyring)
    out: dict[tuple[str, int], tuple[int, str]] = {}
    for table, i, kv, blob in conn.execute("SELECT tableoid::regclass::text, id, key_version, name_cipher FROM people"):
        try:
            out[(table, i)] = (kv, ciphers.cipher(str(kv)).decrypt(bytes(blob)).decode())
        except Exception:  # noqa: BLE001 - any failure to decrypt is what the assertion names
            out[(table, i)] = (kv, "<does not decrypt>")
    return out


@pytest.mark.parametrize("layout", ["inherited", "partitioned"])
def test_no_row_receives_another_rows_value_when_ids_and_xmin_repeat_and_a_row_fails(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, layout: str) -> None:
    keyring = people_on_key_1(pg_conn, keys_file, layout)
    batches: list[int] = []
    result = drain(settings(database_url, keys_file), lambda batch, ids: batches.append(batch))
    # One pass, no sweep: a batch ending between the two rows of one id goes on after the first
    # (id, table, place), not after the id, so the second row is read by the next batch.
    assert batches == list(range(1, len(batches) + 1)) and len(batches) == -(-2 * ROWS // BATCH)
    after = every_row(pg_conn, keyring)
    archive = "people_archive"
    expected = {("people" if layout == "inherited" else "people_live", i): (2, f"TEST live {i}")
                for i in range(1, ROWS + 1)}
    first = 100 if layout == "partitioned" else 0
    expected |= {(archive, first + i): (2, f"TEST archived {first + i}") for i in range(1, ROWS + 1)}
    broken = ("people" if layout == "inherited" else "people_live", BROKEN)
    expected[broken] = (1, "<does not decrypt>")
    assert after == expected
    assert [f.id for f in result.failed] == [str(BROKEN)]
    assert result.reencrypted == 2 * ROWS - 1 and result.stopped is None


@pytest.mark.parametrize("layout", ["inherited", "partitioned"])
def test_a_row_held_locked_in_a_batch_of_repeated_ids_leaves_every_other_row_its_own_value(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, layout: str) -> None:
    # The archive's row 2 is held locked for the whole run: the batch's write waits briefly, then
    # is written again cautiously, skipping it; the other rows are written by position.
    keyring = people_on_key_1(pg_conn, keys_file, layout)
    held = 2 if layout == "inherited" else 102
    app = psycopg.connect(database_url, autocommit=True, application_name="app")
    try:
        app.execute("BEGIN")
        app.execute("SELECT 1 FROM people_archive WHERE id = %s FOR UPDATE", (held,))
        result = drain(settings(database_url, keys_file))
        app.execute("ROLLBACK")
    finally:
        app.close()
    after = every_row(pg_conn, keyring)
    first = 100 if layout == "partitioned" else 0
    live = "people" if layout == "inherited" else "people_live"
    expected = {(live, i): (2, f"TEST live {i}") for i in range(1, ROWS + 1)}
    expected |= {("people_archive", first + i): (2, f"TEST archived {first + i}") for i in range(1, ROWS + 1)}
    expected[(live, BROKEN)] = (1, "<does not decrypt>")
    expected[("people_archive", held)] = (1, f"TEST archived {held}")
    assert after == expected
    assert result.reencrypted == 2 * ROWS - 2 and result.backlog_remaining == 2  # the held row and the FAILED one


def test_a_format_written_by_id_is_blocked_on_a_table_with_inheritance_children(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    # A compare-and-swap format (fpc1) finds a row by its id: on an inheritance tree that may be
    # two rows. It reads no row versions, which is what resolve_target is told for it.
    people_on_key_1(pg_conn, keys_file, "inherited")
    target = settings(database_url, keys_file).targets[0]
    with pytest.raises(TargetBlocked, match="people has inheritance children, whose ids the primary key does not"):
        resolve_target(pg_conn, target, reads_versions=False)
    assert resolve_target(pg_conn, target, reads_versions=True).by_ctid is False
