"""The gate reads one moment of the whole database, completely, and assumes nothing it did not read
(issue 31, contract §6). Real PostgreSQL: a mover moving a row under the key between an archive and a
target while gates run, tables renamed / dropped / truncated between the snapshot and the read, every
value of a column tried (no sample), the encodings and containers programs store ciphertexts in, large
objects, other sessions' temporary tables, NULL key versions of soft-deleted rows, and the run's own gate
section. Each situation keeps the gate closed and names where; with nothing left, the gate opens.
tests/test_gate_moment_mysql.py runs the ``assert_*`` bodies on MariaDB (a ``MomentWorld`` of
tests/moment_world.py per engine; which and why in its docstring).
"""

from __future__ import annotations

import base64
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.rotation import retire_gate  # by the URL's engine, as the command line asks it

from .moment_world import MomentWorld, PgMoment, rotated
from .test_gate_discover import by_column, create_secrets, fpc1_settings, fpc1_value
from .test_targets import settings_for

MOVER_SECONDS = 3.0


@pytest.fixture
def pg_world(database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> PgMoment:
    return PgMoment(database_url, pg_conn, keys_file)


def rotated_people(conn: psycopg.Connection[Any], keys_file: Path, url: str) -> tuple[bytes, Any]:
    return rotated(PgMoment(url, conn, keys_file))


# -- one snapshot ---------------------------------------------------------------------------------------


def assert_a_row_moved_between_an_archive_and_a_target_never_opens_the_gate(world: MomentWorld,
                                                                            seconds: float = MOVER_SECONDS) -> None:
    old, settings = rotated(world)
    world.execute(world.create_like("people_archive", "people"))
    world.execute("INSERT INTO people_archive (id, tenant, key_version, name_cipher) VALUES (1000, 'a', 1, %s)",
                  (old,))
    stop = threading.Event()
    moves = [0]

    def mover() -> None:
        with world.session() as run:
            while not stop.is_set():
                for statement in (*world.move("people_archive", "people"), *world.move("people", "people_archive")):
                    run(statement)
                moves[0] += 2

    thread = threading.Thread(target=mover, daemon=True)
    thread.start()
    verdicts = []
    try:
        started = time.monotonic()
        while time.monotonic() - started < seconds or len(verdicts) < 3:
            report = retire_gate(settings, "1")
            verdicts.append((report.open, report.blocking.get("HISTORICAL", 0) + report.blocking.get(
                "OUTSIDE_TARGETS", 0)))
    finally:
        stop.set()
        thread.join(timeout=10)
    assert moves[0] > len(verdicts)  # the mover really moved while the gates read
    assert all(not is_open and found == 1 for is_open, found in verdicts), verdicts
    world.execute("DROP TABLE people_archive")
    world.execute("DELETE FROM people WHERE id = 1000")
    assert retire_gate(settings, "1").open


def test_a_row_moved_between_an_archive_and_a_target_in_one_statement_never_opens_the_gate(
        pg_world: PgMoment) -> None:
    assert_a_row_moved_between_an_archive_and_a_target_never_opens_the_gate(pg_world)


# -- relations by identity ------------------------------------------------------------------------------


def assert_an_archive_renamed_after_the_snapshot_is_still_read(world: MomentWorld,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    old, settings = rotated(world)
    world.execute(f"CREATE TABLE people_archive (id bigint, name_cipher {world.blob})")
    world.execute("INSERT INTO people_archive VALUES (1, %s)", (old,))
    world.after_snapshot(monkeypatch, [world.rename("people_archive", "people_archive_2026")], target=False)

    report = retire_gate(settings, "1")

    assert not report.open and report.blocking["OUTSIDE_TARGETS"] == 1
    name = "people_archive" if world.renamed_read_as == "old" else "people_archive_2026"
    assert by_column(report.as_dict())[world.label(name) + ".name_cipher"]["by_key"] == {"1": 1}


def test_an_archive_renamed_while_the_gate_reads_is_still_read_under_its_snapshot_name(
        pg_world: PgMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_an_archive_renamed_after_the_snapshot_is_still_read(pg_world, monkeypatch)


def assert_an_archive_dropped_or_truncated_after_the_snapshot_is_unreadable(
        world: MomentWorld, statement: str, monkeypatch: pytest.MonkeyPatch) -> None:
    old, settings = rotated(world)
    world.execute(f"CREATE TABLE people_archive (id bigint, name_cipher {world.blob})")
    world.execute("INSERT INTO people_archive VALUES (1, %s)", (old,))
    world.after_snapshot(monkeypatch, [statement], target=False)

    report = retire_gate(settings, "1")

    assert not report.open and report.blocking["UNREADABLE"] == 1
    reason = report.discovery["unreadable"][world.label("people_archive")]
    assert ("dropped" in reason) if statement.startswith("DROP") else ("rewritten" in reason), reason
    monkeypatch.undo()
    world.execute("DROP TABLE IF EXISTS people_archive")
    assert retire_gate(settings, "1").open


@pytest.mark.parametrize("statement", ["DROP TABLE people_archive", "TRUNCATE people_archive"])
def test_an_archive_dropped_or_truncated_after_the_snapshot_is_unreadable_never_nothing_there(
        statement: str, pg_world: PgMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_an_archive_dropped_or_truncated_after_the_snapshot_is_unreadable(pg_world, statement, monkeypatch)


def assert_a_target_renamed_away_and_replaced_after_the_snapshot_is_blocked(
        world: MomentWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    _, settings = rotated(world)
    world.after_snapshot(monkeypatch, [world.rename("people", "people_old"), world.create_like("people", "people_old")],
                         target=True)
    report = retire_gate(settings, "1")
    assert not report.open and report.blocking["BLOCKED"] == 1
    assert "not the one it was at the gate's snapshot" in report.targets["People"]["blocked_reason"]


def test_a_target_renamed_away_and_replaced_after_the_snapshot_is_blocked(
        pg_world: PgMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_a_target_renamed_away_and_replaced_after_the_snapshot_is_blocked(pg_world, monkeypatch)


def assert_a_target_locked_by_ddl_past_the_lock_timeout_is_blocked_named(
        world: MomentWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target held by DDL (an ALTER copying it, an ACCESS EXCLUSIVE / ``LOCK TABLES ... WRITE``) past
    the gate's bounded wait: the gate decides without it, closed, the target BLOCKED and named (exit 3
    with what to do), never a gate that waits for the DDL nor one that stops without a verdict."""
    _, settings = rotated(world)
    with world.locked_by_ddl("people", monkeypatch):
        report = retire_gate(settings, "1")
    assert not report.open and report.blocking["BLOCKED"] == 1
    reason = report.targets["People"]["blocked_reason"]
    assert "locked by DDL past" in reason and reason.endswith("run the gate again"), reason
    assert retire_gate(settings, "1").open  # the DDL gone, the same look opens


def test_a_target_locked_by_ddl_past_the_lock_timeout_is_blocked_named(
        pg_world: PgMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_a_target_locked_by_ddl_past_the_lock_timeout_is_blocked_named(pg_world, monkeypatch)


# -- every value, every encoding, every container -------------------------------------------------------


def test_the_last_row_of_an_archive_copied_mid_rotation_is_found_no_sample(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    old, settings = rotated_people(pg_conn, keys_file, database_url)
    pg_conn.execute("CREATE TABLE people_copy (id bigint, name_cipher bytea)")
    # 2000 rows on the new key first, the old key's rows after them: a sample of the first rows misses them.
    pg_conn.execute("INSERT INTO people_copy SELECT i, p.name_cipher FROM generate_series(1, 2000) i, "
                    "(SELECT name_cipher FROM people WHERE id = 2) p")
    pg_conn.execute("INSERT INTO people_copy SELECT 2000 + i, %s FROM generate_series(1, 1000) i", (old,))

    found = by_column(retire_gate(settings, "1").as_dict())["public.people_copy.name_cipher"]

    assert found["by_key"] == {"1": 1000} and found["tried"] == 3000


def test_binary_ciphertexts_in_every_encoding_and_container_close_the_gate_each_named(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    old, settings = rotated_people(pg_conn, keys_file, database_url)
    b64 = base64.b64encode(old).decode()
    wrapped = "\n".join(b64[i:i + 16] for i in range(0, len(b64), 16))  # MIME line-wrapped
    encodings = {"hex": old.hex(), "slash_x": "\\x" + old.hex(), "url_unpadded": base64.urlsafe_b64encode(old)
                 .decode().rstrip("="), "mime": wrapped}
    pg_conn.execute("CREATE TYPE pair_t AS (label text, blob bytea)")
    pg_conn.execute("CREATE TYPE textrange_t AS RANGE (subtype = text)")
    pg_conn.execute("CREATE TABLE exported (" + ", ".join(f"{c} text" for c in encodings)
                    + ", in_bytea bytea, arr text[], barr bytea[], doc jsonb, c pair_t)")
    pg_conn.execute("INSERT INTO exported VALUES (" + ", ".join(["%s"] * len(encodings))
                    + ", convert_to(%s, 'UTF8'), ARRAY['x', %s], ARRAY[%s::bytea], "
                      "jsonb_build_object('a', jsonb_build_array(1, %s::text)), "
                      "ROW('n', %s::bytea)::pair_t)",
                    (*encodings.values(), b64, b64, old, b64, old))
    pg_conn.execute("CREATE TABLE ranges (r textrange_t)")
    pg_conn.execute("INSERT INTO ranges VALUES (textrange_t(%s, %s))", (b64, b64 + "z"))
    pg_conn.execute("SELECT lo_from_bytea(0, %s)", (old,))

    report = retire_gate(settings, "1")

    found = {c: f["by_key"] for c, f in by_column(report.as_dict()).items()}
    expected = {f"public.exported.{c}" for c in (*encodings, "in_bytea", "arr", "barr", "doc", "c")}
    expected |= {"public.ranges.r", "pg_largeobject"}
    assert set(found) == expected, found
    assert all(v == {"1": 1} for c, v in found.items() if c != "public.ranges.r"), found
    assert found["public.ranges.r"]["1"] >= 1
    assert not report.open
    pg_conn.execute("DROP TABLE exported, ranges")
    pg_conn.execute("SELECT lo_unlink(oid) FROM pg_largeobject_metadata")
    assert retire_gate(settings, "1").open


def test_fpc1_values_inside_ranges_composites_arrays_and_jsonb_archives_are_found(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    create_secrets(pg_conn)
    settings = fpc1_settings(database_url, keys_file)
    v = fpc1_value("k1")
    pg_conn.execute("CREATE TYPE holder_t AS (note text, n int)")
    pg_conn.execute("CREATE TYPE fpcrange_t AS RANGE (subtype = text)")
    pg_conn.execute("CREATE TABLE odd (r fpcrange_t, c holder_t, a varchar[], j jsonb)")
    pg_conn.execute("INSERT INTO odd VALUES (fpcrange_t(%s, %s), ROW(%s, 1), "
                    "ARRAY[%s], (SELECT to_jsonb(s) FROM (SELECT 1 AS id, %s::text AS secret) s))",
                    (v, v + "z", v, v, v))

    report = retire_gate(settings, "k1")

    assert not report.open
    assert {c: f["by_key"] for c, f in by_column(report.as_dict()).items()} == {
        "public.odd.r": {"k1": 2}, "public.odd.c": {"k1": 1}, "public.odd.a": {"k1": 1},
        "public.odd.j": {"k1": 1}}
    pg_conn.execute("DROP TABLE odd")
    assert retire_gate(settings, "k1").open


# -- sessions and rows the gate cannot read -------------------------------------------------------------


def test_another_sessions_temporary_table_is_unswept_named_by_its_session_never_its_content(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    _, settings = rotated_people(pg_conn, keys_file, database_url)
    with psycopg.connect(database_url, autocommit=True, application_name="etl-step-3") as etl:
        etl.execute("CREATE TEMP TABLE staging (id bigint, name_cipher bytea)")
        pid = etl.info.backend_pid

        report = retire_gate(settings, "1")

        assert not report.open and report.blocking["UNSWEPT"] == 1
        ((name, why),) = report.discovery["unswept"].items()
        assert name.endswith(".staging") and name.startswith("pg_temp_")
        if pg_conn.info.server_version >= 160000:
            assert f"pid {pid}, application_name 'etl-step-3'" in why, why
        skip = settings.model_copy(update={"gate": settings.gate.model_copy(update={"discover_skip": (name,)})})
        assert retire_gate(skip, "1").open
    # The session's end drops its temporary tables, but in its backend, after the client has gone: wait
    # for that (the gate rightly stays closed while the table is there), never past 30 s.
    deadline = time.monotonic() + 30
    while pg_conn.execute("SELECT count(*) FROM pg_class WHERE relname = 'staging' AND relpersistence = 't'"
                          ).fetchone() != (0,):
        assert time.monotonic() < deadline, "the temporary table outlived its session by 30 s"
        time.sleep(0.05)
    assert retire_gate(settings, "1").open


def test_a_soft_deleted_row_with_a_null_key_version_and_a_ciphertext_is_unknown(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    old, _ = rotated_people(pg_conn, keys_file, database_url)
    pg_conn.execute("ALTER TABLE people ADD COLUMN deleted boolean NOT NULL DEFAULT false")
    pg_conn.execute("ALTER TABLE people ALTER COLUMN key_version DROP NOT NULL")
    settings = settings_for(database_url, keys_file, soft_delete="deleted")
    pg_conn.execute("INSERT INTO people (id, tenant, key_version, name_cipher, deleted) VALUES "
                    "(500, 'a', NULL, %s, true), (501, 'a', NULL, NULL, true)", (old,))

    report = retire_gate(settings, "1")

    assert not report.open and report.blocking["UNKNOWN"] == 1 and report.blocking["EXCLUDED"] == 0
    assert not retire_gate(settings, "1", erase_excluded=True).open
    pg_conn.execute("DELETE FROM people WHERE id = 500")
    assert retire_gate(settings, "1").open


def assert_the_runs_gate_section_is_the_deep_verdict_of_gate_retire(world: MomentWorld) -> None:
    old, settings = rotated(world)
    # A stale writer: a key-1 ciphertext labelled with key 2. Counted shallow it is ACTIVE; deep it is FAILED.
    world.execute("UPDATE people SET name_cipher = %s WHERE id = 3", (old,))

    gate = retire_gate(settings, "1")
    run = rotation.run_rotation(settings)

    assert not gate.open and gate.blocking["FAILED"] == 1
    assert run.gate["1"]["open"] is False and run.gate["1"]["blocking"].get("FAILED") == 1


def test_the_runs_gate_section_is_the_deep_verdict_of_gate_retire(pg_world: PgMoment) -> None:
    assert_the_runs_gate_section_is_the_deep_verdict_of_gate_retire(pg_world)


def test_a_writer_that_began_after_the_mark_and_commits_after_the_snapshot_is_waited_for_and_seen(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, settings = rotated_people(pg_conn, keys_file, database_url)
    pg_conn.execute("CREATE TABLE people_archive (id bigint, name_cipher bytea)")
    from pinrotate_core.gate import retire as retire_module

    real_mark = retire_module.mark_before_reads
    writer = psycopg.connect(database_url)  # a stale writer: its transaction starts after the gate's mark

    def mark_then_write(engine: Any) -> Any:
        mark = real_mark(engine)
        writer.execute("INSERT INTO people_archive VALUES (1, %s)", (old,))  # has an xid at the snapshot
        threading.Timer(1.0, writer.commit).start()  # commits after the gate's first look
        return mark

    monkeypatch.setattr(retire_module, "mark_before_reads", mark_then_write)
    try:
        report = retire_gate(settings, "1")
    finally:
        writer.close()

    assert not report.open and report.blocking["OUTSIDE_TARGETS"] == 1, report.durability
    assert report.durability["in_flight"]["second_look"] is True


def test_a_partition_left_detach_pending_is_swept_on_its_own(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    pg_conn.execute("CREATE TABLE secrets (id bigint PRIMARY KEY, secret text) PARTITION BY RANGE (id)")
    pg_conn.execute("CREATE TABLE secrets_new PARTITION OF secrets FOR VALUES FROM (0) TO (100)")
    pg_conn.execute("CREATE TABLE secrets_2023 PARTITION OF secrets FOR VALUES FROM (100) TO (200)")
    pg_conn.execute("INSERT INTO secrets VALUES (1, %s), (150, %s)", (fpc1_value("k3"), fpc1_value("k1")))
    pg_conn.execute("UPDATE secrets SET secret = %s WHERE id = 150", (fpc1_value("k3"),))
    settings = fpc1_settings(database_url, keys_file)
    assert retire_gate(settings, "k1").open
    pg_conn.execute("UPDATE secrets SET secret = %s WHERE id = 150", (fpc1_value("k1"),))
    # DETACH ... CONCURRENTLY cancelled while it waits for a reader: the partition stays DETACH PENDING.
    with psycopg.connect(database_url) as reader, psycopg.connect(database_url, autocommit=True) as ddl:
        reader.execute("SELECT count(*) FROM secrets")
        pid = ddl.info.backend_pid
        detach = threading.Thread(target=lambda: _quietly(ddl, "ALTER TABLE secrets DETACH PARTITION secrets_2023 "
                                                               "CONCURRENTLY"))
        detach.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            row = pg_conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            if row is not None and row[0] == "Lock":
                break
            time.sleep(0.05)
        pg_conn.execute("SELECT pg_cancel_backend(%s)", (pid,))
        detach.join(timeout=10)
        reader.rollback()
    pending = pg_conn.execute("SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = 'secrets_2023'::regclass"
                              ).fetchone()
    assert pending is not None and pending[0] is True

    report = retire_gate(settings, "k1")

    assert not report.open
    assert by_column(report.as_dict())["public.secrets_2023.secret"]["by_key"] == {"k1": 1}


def _quietly(conn: psycopg.Connection[Any], statement: str) -> None:
    try:
        conn.execute(statement)
    except psycopg.errors.QueryCanceled:
        pass


def test_hstore_values_are_searched_and_a_foreign_table_is_unswept_until_vouched_for(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    old, settings = rotated_people(pg_conn, keys_file, database_url)
    pg_conn.execute("CREATE EXTENSION hstore")
    pg_conn.execute("CREATE TABLE prefs (id bigint, attrs hstore)")
    pg_conn.execute("INSERT INTO prefs VALUES (1, hstore('name', %s))", (base64.b64encode(old).decode(),))
    pg_conn.execute("CREATE EXTENSION file_fdw")
    pg_conn.execute("CREATE SERVER files FOREIGN DATA WRAPPER file_fdw")
    pg_conn.execute("CREATE FOREIGN TABLE exported_names (id bigint, name_cipher text) SERVER files "
                    "OPTIONS (filename '/dev/null', format 'csv')")

    report = retire_gate(settings, "1")

    assert not report.open and report.blocking["OUTSIDE_TARGETS"] == 1 and report.blocking["UNSWEPT"] == 1
    assert by_column(report.as_dict())["public.prefs.attrs"]["by_key"] == {"1": 1}
    assert report.discovery["unswept"]["public.exported_names"].startswith("foreign table")
    pg_conn.execute("DROP TABLE prefs")
    skip = settings.model_copy(update={"gate": settings.gate.model_copy(
        update={"discover_skip": ("public.exported_names",)})})
    assert not retire_gate(settings, "1").open
    vouched = retire_gate(skip, "1")
    assert vouched.open and "public.exported_names" in vouched.discovery["not_swept"]


# -- the trial's decodings, on a known-answer vector ------------------------------------------------------

# NIST GCM test case 1 (AES-128, zero key, zero IV, empty plaintext): tag 58e2fccefa7e3061367f1d57a4e7455a.
# As an aesgcm value: nonce(12) || ciphertext (empty) || tag.
NIST_VALUE = bytes(12) + bytes.fromhex("58e2fccefa7e3061367f1d57a4e7455a")


def test_the_trial_finds_a_known_answer_value_in_every_encoding_programs_store() -> None:
    from pinrotate_core.gate.sweep_trial import TrialKeys
    from pinrotate_core.keyring import Key, Keyring

    keyring = Keyring(current="2", keys={"1": Key("1", bytes(16)), "2": Key("2", bytes(range(16)))}, source="test")
    keys = TrialKeys(keyring, ["1"])
    b64 = base64.b64encode(NIST_VALUE)
    forms = {
        "raw": NIST_VALUE, "hex": NIST_VALUE.hex().encode(), "HEX with \\x": b"\\x" + NIST_VALUE.hex().upper().encode(),
        "base64": b64, "base64 unpadded": b64.rstrip(b"="),
        "base64url": base64.urlsafe_b64encode(NIST_VALUE).rstrip(b"="),
        "MIME wrapped": b"\r\n".join(b64[i:i + 8] for i in range(0, len(b64), 8)),
    }
    assert {name: keys.key_of_value(form) for name, form in forms.items()} == dict.fromkeys(forms, "1")
    tampered = NIST_VALUE[:-1] + bytes([NIST_VALUE[-1] ^ 1])
    assert keys.key_of_value(tampered) is None and keys.key_of_value(base64.b64encode(tampered)) is None
    # Only the keys the verdict concerns are tried.
    assert TrialKeys(keyring, ["2"]).key_of_value(NIST_VALUE) is None


def test_an_archive_renamed_back_and_forth_while_gates_run_never_opens_the_gate(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    old, settings = rotated_people(pg_conn, keys_file, database_url)
    pg_conn.execute("CREATE TABLE archive_a (id bigint, name_cipher bytea)")
    pg_conn.execute("INSERT INTO archive_a VALUES (1, %s)", (old,))
    stop = threading.Event()
    renames = [0]

    def renamer() -> None:  # an archive rotation job
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '200ms'")
            names = ("archive_a", "archive_b")
            while not stop.is_set():
                try:
                    conn.execute(f"ALTER TABLE {names[renames[0] % 2]} RENAME TO {names[(renames[0] + 1) % 2]}")
                    renames[0] += 1
                except psycopg.errors.LockNotAvailable:
                    pass

    thread = threading.Thread(target=renamer, daemon=True)
    thread.start()
    verdicts = []
    try:
        started = time.monotonic()
        while time.monotonic() - started < MOVER_SECONDS or len(verdicts) < 3:
            report = retire_gate(settings, "1")
            verdicts.append((report.open, report.blocking.get("OUTSIDE_TARGETS", 0), report.blocking.get("UNREADABLE", 0)))
    finally:
        stop.set()
        thread.join(timeout=10)
    assert renames[0] > len(verdicts)
    assert all(not is_open and (found == 1 or unreadable) for is_open, found, unreadable in verdicts), verdicts
