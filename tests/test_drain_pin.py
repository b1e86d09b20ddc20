"""The aesgcm drain on the Pin profile preset: every row of the design's test table, on real PostgreSQL.

Each test seeds the four preset tables under key 1 (synthetic, deterministic plaintexts), makes
key 2 current, runs the rotation through the core, and then reads the rows back: what moved, what
did not (``xmin``), and what every value decrypts to. No mock of the database or the keys.
"""

from __future__ import annotations

import json
import random
import secrets
import threading
import tomllib
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import rotation
from pinrotate_core.config import Settings, load_settings, settings_from_mapping
from pinrotate_core.drain import BatchEvent
from pinrotate_core.errors import ConfigError, RefusedToStart
from pinrotate_core.gate import evaluate_gate, retire_gate
from pinrotate_core.keyring import Keyring
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.samples import pin_profile as presets
from pinrotate_core.samples.pin_profile import (
    CIPHER_COLUMNS,
    PERSON_DOCUMENTS,
    PERSONS,
    REQUISITE_TEMPLATES,
    TABLES,
    VERIFICATION_REQUESTS,
    SeedSummary,
)
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet

from .helpers import assert_secret_free, b64

ROWS = 600  # persons; the preset adds 300 documents, 150 templates, 150 requests (50 drafts)
BATCH = 100
TARGET_OF = {PERSONS: "Person", PERSON_DOCUMENTS: "PersonDocument", REQUISITE_TEMPLATES: "RequisiteTemplate",
             VERIFICATION_REQUESTS: "VerificationRequest"}
AUDIT = ("version", "updated_at", "updated_by_user_id")

Row = dict[str, Any]


# -- reading the tables back ---------------------------------------------------------------------


def table_rows(conn: psycopg.Connection[Any], table: str) -> dict[uuid.UUID, Row]:
    """Every row of ``profile.<table>`` with all its columns and ``xmin``, by id."""
    cur = conn.execute(sql.SQL("SELECT xmin::text AS xmin, * FROM {}").format(sql.Identifier("profile", table)))
    names = [d.name for d in cur.description or ()]
    out: dict[uuid.UUID, Row] = {}
    for values in cur.fetchall():
        row = dict(zip(names, values))
        out[row["id"]] = row
    return out


def all_rows(conn: psycopg.Connection[Any]) -> dict[str, dict[uuid.UUID, Row]]:
    return {table: table_rows(conn, table) for table in TABLES}


def xmins(conn: psycopg.Connection[Any]) -> dict[str, dict[uuid.UUID, str]]:
    return {table: {i: r["xmin"] for i, r in rows.items()} for table, rows in all_rows(conn).items()}


def decrypt_row(row: Row, table: str, keyring: Keyring) -> dict[str, bytes | None]:
    """Every cipher column of ``row`` decrypted with the key its own key_version names."""
    ciphers = AesGcmCipherSet(keyring)
    out: dict[str, bytes | None] = {}
    for col in CIPHER_COLUMNS[table]:
        value = row[col]
        out[col] = None if value is None else ciphers.decrypt(str(row["key_version"]), bytes(value))
    return out


def ids_in_order(rows: dict[uuid.UUID, Row]) -> list[uuid.UUID]:
    # Python orders UUIDs by their 128-bit value, PostgreSQL by memcmp of the 16 bytes: the same order.
    return sorted(rows)


def by_version(rows: dict[uuid.UUID, Row]) -> dict[Any, int]:
    counts: dict[Any, int] = {}
    for r in rows.values():
        counts[r["key_version"]] = counts.get(r["key_version"], 0) + 1
    return counts


# -- the database under test -------------------------------------------------------------------


@dataclass
class PinDb:
    """A fresh database with the Pin preset schema and a ``file`` keyring beside it."""

    url: str
    conn: psycopg.Connection[Any]
    keys_file: Path
    tmp: Path
    provider: FileKeyProvider = field(init=False)

    def __post_init__(self) -> None:
        self.provider = FileKeyProvider(self.keys_file, create=True)
        self.provider.load_keyring()  # key 1, current 1
        presets.apply_pin_profile_schema(self.conn)

    def keyring(self) -> Keyring:
        return self.provider.load_keyring()

    def seed(self, rows: int = ROWS, *, key_id: str = "1", first_row: int = 0, seed: int = 20240601) -> SeedSummary:
        return presets.seed_pin_profile(self.conn, self.keyring(), rows=rows, key_id=key_id, seed=seed,
                                        first_row=first_row)

    def make_key_2_current(self) -> Keyring:
        self.provider.add_key()
        self.provider.promote("2")
        return self.keyring()

    def raw_settings(self, **job: Any) -> dict[str, Any]:
        raw = tomllib.loads(presets.PIN_PROFILE_TOML.read_text(encoding="utf-8"))
        raw["database"]["url"] = self.url
        raw["keys"]["file"] = str(self.keys_file)
        raw["job"].update({"batch_size": BATCH, "inter_batch_delay": 0, **job})
        return raw

    def settings(self, **job: Any) -> Settings:
        return settings_from_mapping(self.raw_settings(**job), env={})


@pytest.fixture
def pin(database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, tmp_path: Path) -> PinDb:
    return PinDb(database_url, pg_conn, keys_file, tmp_path)


def write_keys_file(path: Path, current: str, keys: dict[str, bytes]) -> Path:
    """A ``file`` keyring written by hand (e.g. one that lost an old key)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lines = [f"current = {current}", "", "[keys]"] + [f'{k} = "{b64(v)}"' for k, v in keys.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    path.chmod(0o600)
    return path


def material(keyring: Keyring) -> list[bytes]:
    return [k.material for k in keyring.keys.values()]


def run_steps(settings: Settings, on_batch: Callable[[rotation.RunContext, BatchEvent], None]) -> rotation.RunReport:
    """``run_rotation``'s steps one by one, with a per-batch hook that sees the run context."""
    ctx = rotation.open_run(settings)
    try:
        keyring = rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        report = rotation.RunReport(ctx.run_id, keyring.current, False)
        for t in ctx.targets:
            report.targets[t.name] = rotation.drain(ctx, t.name, on_batch=lambda ev: on_batch(ctx, ev))
        report.cancelled = ctx.stop.is_set()
        return report
    finally:
        ctx.close()


def assert_all_on_key_2_with_original_plaintexts(conn: psycopg.Connection[Any], summary: SeedSummary,
                                                 keyring: Keyring) -> None:
    expected = summary.expected_plaintexts()
    for table in TABLES:
        rows = table_rows(conn, table)
        assert set(rows) == set(expected[table])
        for row_id, row in rows.items():
            if table == VERIFICATION_REQUESTS and row["snapshot_cipher"] is None:
                assert row["key_version"] is None
                continue
            assert row["key_version"] == 2, (table, row_id)
            assert decrypt_row(row, table, keyring) == expected[table][row_id], (table, row_id)


# -- the design's table of tests -----------------------------------------------------------------


def test_empty_backlog_is_a_no_op_that_selects_and_touches_nothing(pin: PinDb) -> None:
    pin.make_key_2_current()
    summary = pin.seed(key_id="2")  # everything already on the current key
    before = xmins(pin.conn)

    report = rotation.run_rotation(pin.settings())

    assert report.exit_code == 0
    for name, r in report.targets.items():
        assert (r.reencrypted, r.batches, r.backlog_before, r.backlog_remaining, r.failed) == (0, 0, 0, 0, []), name
        assert r.stopped is None
    assert xmins(pin.conn) == before
    assert report.gate["1"]["open"] is True
    assert_all_on_key_2_with_original_plaintexts(pin.conn, summary, pin.keyring())


def test_every_cipher_field_of_all_four_targets_round_trips_to_the_original_plaintext_under_key_2(pin: PinDb) -> None:
    summary = pin.seed()
    before = all_rows(pin.conn)
    keyring = pin.make_key_2_current()

    report = rotation.run_rotation(pin.settings())

    assert report.exit_code == 0
    assert {n: r.reencrypted for n, r in report.targets.items()} == {
        "Person": summary.persons, "PersonDocument": summary.person_documents,
        "RequisiteTemplate": summary.requisite_templates,
        "VerificationRequest": summary.verification_requests - summary.drafts,
    }
    assert all(r.backlog_remaining == 0 and r.stopped is None for r in report.targets.values())
    assert all(v["ok"] and v["sampled"] > 0 for v in report.verified.values())
    assert report.gate["1"] == {"open": True, "blocking": {}}
    assert_all_on_key_2_with_original_plaintexts(pin.conn, summary, keyring)
    # Re-encrypted, not copied: every non-NULL value is a new ciphertext (fresh nonce, new key).
    after = all_rows(pin.conn)
    for table in TABLES:
        for row_id, row in after[table].items():
            for col in CIPHER_COLUMNS[table]:
                if row[col] is not None:
                    assert row[col] != before[table][row_id][col], (table, col)


def test_verification_snapshot_decrypts_byte_identical_and_its_version_status_submitted_at_are_unchanged(
        pin: PinDb) -> None:
    pin.seed()
    keyring = pin.make_key_2_current()
    before = table_rows(pin.conn, VERIFICATION_REQUESTS)
    plain_before = {i: decrypt_row(r, VERIFICATION_REQUESTS, keyring) for i, r in before.items()}

    assert rotation.run_rotation(pin.settings()).exit_code == 0

    after = table_rows(pin.conn, VERIFICATION_REQUESTS)
    submitted = [i for i, r in before.items() if r["snapshot_cipher"] is not None]
    assert submitted
    for row_id in submitted:
        old, new = before[row_id], after[row_id]
        assert new["snapshot_cipher"] != old["snapshot_cipher"]
        assert new["key_version"] == 2
        assert decrypt_row(new, VERIFICATION_REQUESTS, keyring) == plain_before[row_id]  # byte for byte
        for col in ("version", "status", "submitted_at"):
            assert new[col] == old[col], col


def test_business_version_updated_at_updated_by_are_unchanged_while_xmin_changed_in_all_four_tables(
        pin: PinDb) -> None:
    pin.seed()
    pin.make_key_2_current()
    before = all_rows(pin.conn)

    assert rotation.run_rotation(pin.settings()).exit_code == 0

    after = all_rows(pin.conn)
    for table in TABLES:
        moved = [i for i, r in before[table].items() if r["key_version"] is not None]
        assert moved
        rotated = {*CIPHER_COLUMNS[table], "key_version", "xmin"}
        for row_id in moved:
            old, new = before[table][row_id], after[table][row_id]
            assert new["xmin"] != old["xmin"], (table, "the row was rewritten")
            for col in AUDIT:
                assert new[col] == old[col], (table, col)
            # Beyond the audit trio: no column but the ciphers and the key version changed at all.
            assert {c: v for c, v in new.items() if c not in rotated} == \
                   {c: v for c, v in old.items() if c not in rotated}, table


def test_nullable_ciphers_stay_null_and_only_the_present_values_are_reencrypted_with_key_version_set(
        pin: PinDb) -> None:
    summary = pin.seed()
    keyring = pin.make_key_2_current()
    before = all_rows(pin.conn)
    expected = summary.expected_plaintexts()

    assert rotation.run_rotation(pin.settings()).exit_code == 0

    after = all_rows(pin.conn)
    persons = after[PERSONS]
    no_middle = [i for i, r in persons.items() if r["middle_name_cipher"] is None]
    no_birth = [i for i, r in persons.items() if r["birth_date_cipher"] is None]
    assert no_middle and no_birth and set(no_middle) != set(no_birth)
    for row_id in {*no_middle, *no_birth}:
        row = persons[row_id]
        assert row["key_version"] == 2
        assert decrypt_row(row, PERSONS, keyring) == expected[PERSONS][row_id]
        for col in ("middle_name_cipher", "birth_date_cipher"):
            assert (row[col] is None) == (before[PERSONS][row_id][col] is None), col

    templates = after[REQUISITE_TEMPLATES]
    kinds = {"none": 0, "email": 0, "phone": 0, "both": 0}
    for row_id, row in templates.items():
        email, phone = row["contact_email_cipher"], row["contact_phone_cipher"]
        kind = {(False, False): "none", (True, False): "email", (False, True): "phone", (True, True): "both"}[
            (email is not None, phone is not None)]
        kinds[kind] += 1
        assert row["key_version"] == 2  # also when both contacts are NULL: the row leaves the backlog
        assert row["xmin"] != before[REQUISITE_TEMPLATES][row_id]["xmin"]
        assert decrypt_row(row, REQUISITE_TEMPLATES, keyring) == expected[REQUISITE_TEMPLATES][row_id]
        old = before[REQUISITE_TEMPLATES][row_id]
        assert (old["contact_email_cipher"] is None, old["contact_phone_cipher"] is None) == \
               (email is None, phone is None)
    assert all(kinds.values()), kinds  # every NULL pattern was present and moved


def test_document_number_hash_and_mask_are_never_touched(pin: PinDb) -> None:
    pin.seed()
    pin.make_key_2_current()
    before = table_rows(pin.conn, PERSON_DOCUMENTS)

    assert rotation.run_rotation(pin.settings()).exit_code == 0

    after = table_rows(pin.conn, PERSON_DOCUMENTS)
    for row_id, old in before.items():
        new = after[row_id]
        assert new["key_version"] == 2 and new["payload_cipher"] != old["payload_cipher"]
        assert bytes(new["number_hash"]) == bytes(old["number_hash"])
        assert new["number_mask"].encode() == old["number_mask"].encode()


def test_draft_requests_without_a_snapshot_are_not_selected_and_are_counted_excluded(pin: PinDb) -> None:
    summary = pin.seed()
    pin.make_key_2_current()
    before = table_rows(pin.conn, VERIFICATION_REQUESTS)
    drafts = {i: r for i, r in before.items() if r["snapshot_cipher"] is None}
    assert len(drafts) == summary.drafts > 0

    report = rotation.run_rotation(pin.settings())

    assert report.exit_code == 0
    vr = report.targets["VerificationRequest"]
    assert vr.backlog_before == vr.reencrypted == summary.verification_requests - summary.drafts
    after = table_rows(pin.conn, VERIFICATION_REQUESTS)
    for row_id, old in drafts.items():
        assert after[row_id]["key_version"] is None
        assert after[row_id]["snapshot_cipher"] is None
        assert after[row_id]["xmin"] == old["xmin"]
    inv = rotation.inventory(pin.settings()).targets["VerificationRequest"]
    assert inv.counts["EXCLUDED"] == summary.drafts
    assert inv.counts["ACTIVE"] == summary.verification_requests - summary.drafts
    assert inv.counts["HISTORICAL"] == 0


def test_rows_on_a_newer_key_after_a_rollback_are_never_selected_or_downgraded(pin: PinDb) -> None:
    pin.seed(first_row=0)
    pin.provider.add_key()  # 2
    pin.provider.add_key()  # 3
    pin.provider.promote("3")
    pin.seed(200, key_id="3", first_row=ROWS)  # written while key 3 was current
    pin.provider.promote("2")  # key rolled back: 2 is current again
    keyring = pin.keyring()
    before = all_rows(pin.conn)
    newer = {t: {i: r for i, r in rows.items() if r["key_version"] == 3} for t, rows in before.items()}
    assert all(newer.values())

    report = rotation.run_rotation(pin.settings())

    assert report.exit_code == 0
    after = all_rows(pin.conn)
    for table, rows in newer.items():
        assert report.targets[TARGET_OF[table]].reencrypted == sum(
            1 for r in before[table].values() if r["key_version"] == 1)
        for row_id, old in rows.items():
            assert after[table][row_id]["key_version"] == 3
            assert after[table][row_id]["xmin"] == old["xmin"]
            assert decrypt_row(after[table][row_id], table, keyring) == decrypt_row(old, table, keyring)
        assert set(by_version(after[table])) <= {2, 3, None}
    inv = rotation.inventory(pin.settings())
    for table, rows in newer.items():
        assert inv.targets[TARGET_OF[table]].counts["NEWER"] == len(rows)
        assert inv.targets[TARGET_OF[table]].counts["HISTORICAL"] == 0
    # Key 1 may go; key 3 still holds data and must not.
    assert report.gate["1"]["open"] is True
    assert report.gate["3"]["open"] is False and report.gate["3"]["blocking"]["NEWER"] > 0


@pytest.mark.parametrize("provider", ["file", "env"])
def test_a_missing_old_key_rolls_the_batch_back_and_leaves_every_row_on_the_old_key(
        pin: PinDb, provider: str, monkeypatch: pytest.MonkeyPatch, log_lines: list[str]) -> None:
    pin.seed()
    before = all_rows(pin.conn)
    only_key_2 = secrets.token_bytes(32)
    raw = pin.raw_settings()
    if provider == "file":
        raw["keys"]["file"] = str(write_keys_file(pin.tmp / "lost" / "keys.toml", "2", {"2": only_key_2}))
    else:
        raw["keys"] = {"provider": "env"}
        monkeypatch.setenv("PINROTATE_KEY_CURRENT", "2")
        monkeypatch.setenv("PINROTATE_KEY_2", b64(only_key_2))
    textfile = pin.tmp / "metrics" / "pinrotate.prom"
    textfile.parent.mkdir()
    raw["metrics"]["textfile"] = str(textfile)

    report = rotation.run_rotation(settings_from_mapping(raw, env={}))

    assert report.exit_code == rotation.EXIT_FAIL_CLOSED == 4
    for name, r in report.targets.items():
        assert r.stopped == "key_unavailable", name
        assert r.reencrypted == 0 and r.batches == 0 and r.backlog_remaining == r.backlog_before > 0
        assert r.retryable is False
        assert r.error is not None and "key 1" in r.error
    assert all_rows(pin.conn) == before  # byte-identical, xmin included
    document = json.dumps(report.as_dict())
    assert json.loads(document)["targets"]["Person"]["stopped"] == "key_unavailable"
    assert "key 1" in json.loads(document)["targets"]["Person"]["error"]
    logged = "\n".join(log_lines)
    assert "event=batch_failed" in logged and "reason=key_unavailable" in logged
    assert_secret_free(document + logged, only_key_2, *material(pin.keyring()))
    # errors_total{reason="key_unavailable"} grew (one per stopped target); nothing was processed.
    metrics = textfile.read_text()
    assert 'profile_crypto_reencrypt_errors_total{reason="key_unavailable"} 4.0' in metrics
    assert_secret_free(metrics, only_key_2)


def test_a_second_run_reencrypts_nothing_and_touches_no_row(pin: PinDb) -> None:
    summary = pin.seed()
    keyring = pin.make_key_2_current()
    first = rotation.run_rotation(pin.settings())
    assert first.exit_code == 0 and sum(r.reencrypted for r in first.targets.values()) > 0
    before = xmins(pin.conn)

    second = rotation.run_rotation(pin.settings())

    assert second.exit_code == 0
    assert {n: (r.reencrypted, r.batches) for n, r in second.targets.items()} == dict.fromkeys(first.targets, (0, 0))
    assert xmins(pin.conn) == before
    assert_all_on_key_2_with_original_plaintexts(pin.conn, summary, keyring)


@dataclass(frozen=True)
class AppEdit:
    person_id: uuid.UUID
    key_before: int  # the row's key when the application locked it: 1 means the app moved it itself
    version_before: int
    first_name: bytes


def edit_persons_like_the_application(url: str, keyring: Keyring, ids: list[uuid.UUID], runs_started: threading.Event,
                                      runs_done: threading.Event, edits: list[AppEdit]) -> None:
    """Short single-row transactions: lock, decrypt with the row's key, change the first name,
    write every field under the current key with key_version = 2 and version + 1 (as the service does)."""
    ciphers = AesGcmCipherSet(keyring)
    cols = CIPHER_COLUMNS[PERSONS]
    select = sql.SQL("SELECT key_version, version, {} FROM profile.persons WHERE id = %s FOR UPDATE").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in cols))
    update = sql.SQL("UPDATE profile.persons SET {}, key_version = %s, version = version + 1, updated_at = now() "
                     "WHERE id = %s").format(sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(c))
                                                                   for c in cols))
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            for n, person_id in enumerate(ids):
                if n >= 20:
                    runs_started.set()  # the runs start once the application is busy
                    if runs_done.is_set():
                        break
                first_name = f"Edited-{n:06d}".encode()
                with conn.transaction():
                    row = conn.execute(select, (person_id,)).fetchone()
                    assert row is not None
                    key_before, version_before, *stored = row
                    plain = [None if v is None else ciphers.decrypt(str(key_before), bytes(v)) for v in stored]
                    plain[0] = first_name
                    fresh = [None if p is None else ciphers.encrypt_current(p) for p in plain]
                    conn.execute(update, (*fresh, keyring.current_version, person_id))
                edits.append(AppEdit(person_id, key_before, version_before, first_name))
    finally:
        runs_started.set()  # never leave the runs waiting, even if an edit failed


def test_two_parallel_runs_and_concurrent_application_edits_reencrypt_no_row_twice_and_lose_no_edit(
        pin: PinDb) -> None:
    summary = pin.seed(2000)
    keyring = pin.make_key_2_current()
    before = all_rows(pin.conn)
    settings = pin.settings(batch_size=50)
    person_ids = list(before[PERSONS])
    random.Random(7).shuffle(person_ids)
    edits: list[AppEdit] = []
    runs_started, runs_done = threading.Event(), threading.Event()

    with ThreadPoolExecutor(max_workers=3) as pool:
        app = pool.submit(edit_persons_like_the_application, pin.url, keyring, person_ids[:600], runs_started,
                          runs_done, edits)
        runs_started.wait()
        try:
            futures = [pool.submit(rotation.run_rotation, settings) for _ in range(2)]
            reports = [f.result() for f in futures]
        finally:
            runs_done.set()
        app.result()

    assert [r.exit_code for r in reports] == [0, 0]
    moved_by_app = sum(1 for e in edits if e.key_before == 1)
    reencrypted = {name: sum(r.targets[name].reencrypted for r in reports) for name in reports[0].targets}
    # No row twice: the runs together re-encrypted exactly the backlog the application left them.
    assert reencrypted == {
        "Person": summary.persons - moved_by_app, "PersonDocument": summary.person_documents,
        "RequisiteTemplate": summary.requisite_templates,
        "VerificationRequest": summary.verification_requests - summary.drafts,
    }
    after = all_rows(pin.conn)
    edited = {e.person_id: e for e in edits}
    assert len(edited) == len(edits) >= 20
    expected = summary.expected_plaintexts()
    for table in TABLES:
        for row_id, row in after[table].items():
            if row["key_version"] is None:
                assert table == VERIFICATION_REQUESTS and row["snapshot_cipher"] is None
                continue
            assert row["key_version"] == 2, table
            want = dict(expected[table][row_id])
            if table == PERSONS and row_id in edited:
                want["first_name_cipher"] = edited[row_id].first_name  # the edit survived
                assert row["version"] == edited[row_id].version_before + 1
            else:
                assert {c: row[c] for c in AUDIT} == {c: before[table][row_id][c] for c in AUDIT}
            assert decrypt_row(row, table, keyring) == want, table


def test_cancellation_between_batches_keeps_the_committed_batches_and_moves_no_row_by_half(pin: PinDb) -> None:
    summary = pin.seed()
    keyring = pin.make_key_2_current()
    before = all_rows(pin.conn)
    events: list[BatchEvent] = []

    def stop_after_batch_2(ctx: rotation.RunContext, ev: BatchEvent) -> None:
        events.append(ev)
        if ev.target == "Person" and ev.batch == 2:
            ctx.stop.set()  # what SIGTERM or a Prefect cancellation does

    report = run_steps(pin.settings(), stop_after_batch_2)

    assert report.exit_code == rotation.EXIT_TERMINATED == 143
    person = report.targets["Person"]
    assert person.stopped == "cancelled"
    committed = [ev for ev in events if ev.target == "Person"]
    assert [ev.batch for ev in committed] == list(range(1, len(committed) + 1))
    assert len(committed) in (2, 3)  # the batch open at the stop may finish; no later batch starts
    assert person.reencrypted == sum(ev.reencrypted for ev in committed) == len(committed) * BATCH
    assert person.reencrypted < summary.persons
    for name in ("PersonDocument", "RequisiteTemplate", "VerificationRequest"):
        assert report.targets[name].stopped == "cancelled" and report.targets[name].reencrypted == 0

    after = all_rows(pin.conn)
    order = ids_in_order(before[PERSONS])
    moved, left = order[:person.reencrypted], order[person.reencrypted:]
    assert all(after[PERSONS][i]["key_version"] == 2 for i in moved)
    assert all(after[PERSONS][i] == before[PERSONS][i] for i in left)  # untouched, xmin included
    for table in (PERSON_DOCUMENTS, REQUISITE_TEMPLATES, VERIFICATION_REQUESTS):
        assert after[table] == before[table]
    # No row half-moved: every field of every row decrypts under the row's own key.
    expected = summary.expected_plaintexts()
    for row_id, row in after[PERSONS].items():
        assert decrypt_row(row, PERSONS, keyring) == expected[PERSONS][row_id]

    # A restart finishes the job from the key-version column alone.
    again = rotation.run_rotation(pin.settings())
    assert again.exit_code == 0
    assert again.targets["Person"].reencrypted == summary.persons - person.reencrypted
    assert_all_on_key_2_with_original_plaintexts(pin.conn, summary, keyring)


def test_a_key_that_becomes_unavailable_mid_run_commits_the_batches_before_and_rolls_back_its_batch(
        pin: PinDb) -> None:
    # Everything on key 2, key 3 current. One person row further down the id order is still on
    # key 1, and key 1 has gone from the keyring: batches before it commit, its batch rolls back.
    pin.provider.add_key()
    pin.provider.add_key()
    summary = pin.seed(key_id="2")
    full = pin.keyring()
    ciphers = AesGcmCipherSet(full)
    order = ids_in_order(table_rows(pin.conn, PERSONS))
    stale = order[2 * BATCH + BATCH // 2]  # in the third batch
    row = table_rows(pin.conn, PERSONS)[stale]
    cols = CIPHER_COLUMNS[PERSONS]
    old_values = [None if row[c] is None else ciphers.cipher("1").encrypt(ciphers.decrypt("2", row[c])) for c in cols]
    pin.conn.execute(
        sql.SQL("UPDATE profile.persons SET {}, key_version = 1 WHERE id = %s").format(
            sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(c)) for c in cols)),
        (*old_values, stale))
    write_keys_file(pin.keys_file, "3", {"2": full.keys["2"].material, "3": full.keys["3"].material})
    keyring = pin.keyring()
    assert keyring.ids() == ["2", "3"]
    before = all_rows(pin.conn)

    report = rotation.run_rotation(pin.settings())

    assert report.exit_code == 4
    person = report.targets["Person"]
    assert person.stopped == "key_unavailable" and "key 1" in (person.error or "")
    assert (person.batches, person.reencrypted) == (2, 2 * BATCH)
    assert person.backlog_remaining == summary.persons - 2 * BATCH
    after = table_rows(pin.conn, PERSONS)
    for i in order[:2 * BATCH]:
        assert after[i]["key_version"] == 3
        assert decrypt_row(after[i], PERSONS, keyring) == decrypt_row(before[PERSONS][i], PERSONS, full)
    for i in order[2 * BATCH:]:
        assert after[i] == before[PERSONS][i]  # the failed batch rolled back whole; the rest never started
    # The other targets were not affected by Person's stop.
    for name in ("PersonDocument", "RequisiteTemplate", "VerificationRequest"):
        assert report.targets[name].stopped is None and report.targets[name].backlog_remaining == 0
    assert report.gate["2"]["open"] is False


def test_a_corrupt_row_is_isolated_reported_without_values_and_keeps_the_gate_closed(pin: PinDb,
                                                                                      log_lines: list[str]) -> None:
    summary = pin.seed()
    keyring = pin.make_key_2_current()
    order = ids_in_order(table_rows(pin.conn, PERSONS))
    bad_id = order[BATCH + 7]
    stored = bytearray(table_rows(pin.conn, PERSONS)[bad_id]["last_name_cipher"])
    stored[20] ^= 0x01  # one flipped bit inside the ciphertext: the tag no longer matches
    pin.conn.execute("UPDATE profile.persons SET last_name_cipher = %s WHERE id = %s", (bytes(stored), bad_id))
    before = all_rows(pin.conn)

    report = rotation.run_rotation(pin.settings())

    assert report.exit_code == 4
    person = report.targets["Person"]
    assert person.stopped is None  # the other rows went on
    assert [f.as_dict() for f in person.failed] == [
        {"target": "Person", "id": str(bad_id), "columns": ["last_name_cipher"], "reason": "decrypt_failed"}]
    assert person.reencrypted == summary.persons - 1 and person.backlog_remaining == 1
    after = all_rows(pin.conn)
    assert after[PERSONS][bad_id] == before[PERSONS][bad_id]
    expected = summary.expected_plaintexts()
    for row_id, row in after[PERSONS].items():
        if row_id != bad_id:
            assert row["key_version"] == 2
            assert decrypt_row(row, PERSONS, keyring) == expected[PERSONS][row_id]
    document = json.dumps(report.as_dict())
    assert json.loads(document)["targets"]["Person"]["failed_rows"] == [f.as_dict() for f in person.failed]
    bad_plain = expected[PERSONS][bad_id]
    logged = "\n".join(log_lines)
    assert f"event=row_failed run_id={report.run_id} target=Person id={bad_id} columns=last_name_cipher " \
           "reason=decrypt_failed" in logged
    assert_secret_free(document + logged, bytes(stored), *material(keyring),
                       *(v for v in bad_plain.values() if v is not None))
    # The gate for key 1 stays closed: one row is still on it and it does not decrypt.
    assert report.gate["1"]["open"] is False
    assert report.gate["1"]["blocking"] == {"FAILED": 1, "HISTORICAL": 1}
    deep = rotation.inventory(pin.settings(), deep=True)
    assert deep.targets["Person"].counts["FAILED"] == 1
    assert deep.targets["Person"].counts["HISTORICAL"] == 1
    assert deep.total("FAILED") == 1
    assert evaluate_gate(deep, "1").open is False
    retire = retire_gate(pin.settings(), "1")  # what `gate --retire 1` decides on
    assert retire.open is False and retire.blocking["FAILED"] == 1 and retire.blocking["HISTORICAL"] == 1


def test_max_run_duration_stops_at_the_deadline_leaves_the_rest_and_a_later_run_finishes(pin: PinDb) -> None:
    summary = pin.seed()
    keyring = pin.make_key_2_current()
    before = xmins(pin.conn)

    short = rotation.run_rotation(pin.settings(max_run_duration=1e-6, batch_size=50, inter_batch_delay=0.01))

    assert short.exit_code == 0  # a deadline is not a failure: the rest is for the next run
    for name, r in short.targets.items():
        assert r.stopped == "deadline", name
        assert r.backlog_remaining == r.backlog_before - r.reencrypted > 0
    assert xmins(pin.conn) == before

    rest = rotation.run_rotation(pin.settings())
    assert rest.exit_code == 0
    assert all(r.backlog_remaining == 0 and r.stopped is None for r in rest.targets.values())
    assert_all_on_key_2_with_original_plaintexts(pin.conn, summary, keyring)


def test_two_workers_per_target_reach_the_same_end_state(pin: PinDb) -> None:
    summary = pin.seed(1200)
    keyring = pin.make_key_2_current()

    report = rotation.run_rotation(pin.settings(max_degree_of_parallelism=2))

    assert report.exit_code == 0
    person = report.targets["Person"]
    assert person.reencrypted == summary.persons and person.batches >= summary.persons // BATCH
    assert all(r.backlog_remaining == 0 for r in report.targets.values())
    assert_all_on_key_2_with_original_plaintexts(pin.conn, summary, keyring)


def test_a_dry_run_reports_what_a_real_run_would_do_and_writes_nothing(pin: PinDb) -> None:
    summary = pin.seed()
    pin.make_key_2_current()
    before = all_rows(pin.conn)

    dry = rotation.run_rotation(pin.settings(max_degree_of_parallelism=2), dry_run=True)

    assert dry.exit_code == 0 and dry.dry_run is True
    assert all_rows(pin.conn) == before
    real = rotation.run_rotation(pin.settings())
    assert {n: r.reencrypted for n, r in dry.targets.items()} == {n: r.reencrypted for n, r in real.targets.items()}
    assert dry.targets["Person"].reencrypted == summary.persons
    assert real.exit_code == 0


def test_only_the_chosen_targets_are_drained(pin: PinDb) -> None:
    pin.seed()
    pin.make_key_2_current()
    before = all_rows(pin.conn)

    report = rotation.run_rotation(pin.settings(), target_names=["PersonDocument"])

    assert list(report.targets) == ["PersonDocument"] and report.exit_code == 0
    after = all_rows(pin.conn)
    assert set(by_version(after[PERSON_DOCUMENTS])) == {2}
    for table in (PERSONS, REQUISITE_TEMPLATES, VERIFICATION_REQUESTS):
        assert after[table] == before[table]


def test_a_run_that_finds_the_single_instance_lock_held_exits_0_and_touches_nothing(pin: PinDb) -> None:
    pin.seed(200)
    pin.make_key_2_current()
    before = xmins(pin.conn)
    lock = (rotation.LOCK_NAME,)
    with psycopg.connect(pin.url, autocommit=True) as other_run:
        other_run.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", lock)
        report = rotation.run_rotation(pin.settings(single_instance=True))
        assert report.exit_code == 0 and report.targets == {}
        assert report.skipped is not None and rotation.LOCK_NAME in report.skipped
        assert xmins(pin.conn) == before
        # Without the option the lock means nothing: it is never needed for correctness.
        assert rotation.run_rotation(pin.settings()).exit_code == 0
    assert all(set(by_version(rows)) <= {2, None} for rows in all_rows(pin.conn).values())


def test_an_expected_key_version_that_is_not_current_refuses_to_start_and_touches_nothing(pin: PinDb) -> None:
    pin.seed(200)
    pin.make_key_2_current()
    before = xmins(pin.conn)
    with pytest.raises(RefusedToStart, match=r"--expected-key-version 3 is not the current key \(2\); nothing"):
        rotation.run_rotation(pin.settings(), expected_key="3")
    assert xmins(pin.conn) == before
    assert rotation.run_rotation(pin.settings(), expected_key="2").exit_code == 0


# -- bad configuration: an error naming the setting, and nothing touched ------------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(raw: dict[str, Any]) -> None:
        node: Any = raw
        *parents, last = path.split(".")
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return apply


_DELETE = object()

BAD_SETTINGS = {
    "batch_size_0": (_set("job.batch_size", 0), "job.batch_size"),
    "unknown_setting": (_set("job.batchsize", 50), "job.batchsize: unknown setting"),
    "aesgcm_without_key_version": (_set("targets.1.key_version", _DELETE),
                                   'target "PersonDocument": an aesgcm target needs'),
}


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_an_invalid_setting_is_a_config_error_naming_it_and_touches_nothing(pin: PinDb, case: str) -> None:
    pin.seed(200)
    pin.make_key_2_current()
    before = xmins(pin.conn)
    mutate, named = BAD_SETTINGS[case]
    raw = pin.raw_settings()
    mutate(raw)
    path = pin.tmp / "pinrotate.toml"
    path.write_text(_toml(raw), encoding="utf-8")

    with pytest.raises(ConfigError) as err:
        load_settings(path, env={})
    assert named in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)
    assert xmins(pin.conn) == before


@pytest.mark.parametrize("extra, reason", [
    ({"name": "Ghost", "table": "profile.ghosts", "key_version": "key_version", "columns": ["secret_cipher"]},
     "table profile.ghosts does not exist"),
    ({"name": "Nick", "table": "profile.persons", "key_version": "key_version", "columns": ["nickname_cipher"]},
     "cipher column nickname_cipher does not exist"),
    ({"name": "Gender", "table": "profile.persons", "key_version": "gender", "columns": ["first_name_cipher"]},
     "key_version column gender is text, not an integer"),
])
def test_a_target_that_does_not_resolve_stops_the_start_before_any_row_is_touched(
        pin: PinDb, extra: dict[str, Any], reason: str) -> None:
    pin.seed(200)
    pin.make_key_2_current()
    before = xmins(pin.conn)
    raw = pin.raw_settings()
    raw["targets"].append({"format": "aesgcm", **extra})  # last: the four good targets come first
    settings = settings_from_mapping(raw, env={})

    with pytest.raises(ConfigError) as err:
        rotation.run_rotation(settings)

    message = str(err.value)
    assert f"target {extra['name']}" in message and reason in message and "nothing was touched" in message
    assert xmins(pin.conn) == before
    # The same check is what resolve_all does for the flow's own steps.
    ctx = rotation.open_run(settings)
    try:
        rotation.read_current_key(ctx)
        with pytest.raises(ConfigError, match="nothing was touched"):
            rotation.resolve_all(ctx)
    finally:
        ctx.close()
    assert xmins(pin.conn) == before


def _toml(raw: dict[str, Any]) -> str:
    """Just enough TOML for the preset's configuration (tables, arrays of tables, scalars, lists)."""
    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {scalar(x)}" for k, x in v.items()) + "}"
        raise TypeError(type(v).__name__)

    lines: list[str] = []
    for section, body in raw.items():
        if isinstance(body, list):
            for item in body:
                lines.append(f"[[{section}]]")
                lines += [f"{k} = {scalar(v)}" for k, v in item.items()]
        elif isinstance(body, dict):
            lines.append(f"[{section}]")
            lines += [f"{k} = {scalar(v)}" for k, v in body.items()]
        else:
            lines.insert(0, f"{section} = {scalar(body)}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("sampled", "asked", "min_batches"), [(False, 4, 1), (True, 4, 1), (True, 8, 4)],
                         ids=["exact-quantiles", "sampled-quantiles", "merged-to-4"])
def test_shards_cover_the_backlog_exactly_once_with_similar_counts_and_drain_it_all(
        pin: PinDb, monkeypatch: pytest.MonkeyPatch, log_lines: list[str], sampled: bool, asked: int,
        min_batches: int) -> None:
    # A big backlog's quantiles come from a page sample (TABLESAMPLE SYSTEM) and its shards' backlogs
    # are estimates from it (no counting scan of a huge table while every worker waits); a small
    # one's come from every stale id, and the shards' exact counts add up to the backlog. Either
    # way, draining every shard from its planned backlog moves it all and leaves nothing behind.
    import pinrotate_core.drain.shards as drain_module

    # 16 batches of 100: at least 1 batch a shard allows the 4 or 8 shards asked, at least 4 merges 8 into 4.
    monkeypatch.setattr(drain_module, "MIN_BATCHES_PER_SHARD", min_batches)
    if sampled:  # 1,600 persons > 2 x 400: the quantiles of a quarter of the table's pages
        monkeypatch.setattr(drain_module, "SAMPLE_ROWS", 400)
        monkeypatch.setattr(drain_module, "MIN_SAMPLE_PER_RANGE", 1)
    summary = pin.seed(1600)
    keyring = pin.make_key_2_current()
    ctx = rotation.open_run(pin.settings(), run_id="shards")
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        # Analyzed, as autovacuum would have: the sample is sized by the planner's estimate of the rows.
        pin.conn.execute("ANALYZE profile.persons")
        shards = rotation.plan_shards(ctx, "Person", asked)
        assert len(shards) == 4
        bounds = [s.id_range for s in shards]
        assert bounds[0][0] is None and bounds[-1][1] is None
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, none overlapping
        assert any("event=shards_sampled" in line for line in log_lines) == sampled
        counts = [s.rows for s in shards]
        assert all(s.exact for s in shards) != sampled and not any(s.exact for s in shards) == sampled
        if not sampled:
            assert sum(counts) == summary.persons
            assert max(counts) - min(counts) <= 100, counts  # exact quantiles: within a batch of the fair share
        else:  # a quarter of the pages stands for the whole: an estimate, equal shares
            assert 0.5 * summary.persons < sum(counts) < 1.5 * summary.persons, counts
            assert max(counts) - min(counts) <= 1, counts
        # As the flow's drain task does: from the planned backlog, estimated or not.
        results = [rotation.drain(ctx, "Person", workers=1, id_range=s.id_range, planned_backlog=s.rows)
                   for s in shards]
        assert all(r.backlog_remaining == 0 and not r.failed for r in results)
        per_shard = [r.reencrypted for r in results]
        assert max(per_shard) < 2.5 * summary.persons / 4, per_shard  # similar sizes, even from a sample
        moved = sum(per_shard)
    finally:
        ctx.close()
    assert moved == summary.persons
    person_versions = {row[0] for row in pin.conn.execute("SELECT DISTINCT key_version FROM profile.persons")}
    assert person_versions == {2}
    assert keyring.current == "2"


def test_merging_adjacent_ranges_keeps_exact_counts_and_balances_them() -> None:
    from pinrotate_core.drain.shards import _merge_ranges

    assert _merge_ranges(["b", "d", "f"], [10, 10, 10, 10], 4) == (["b", "d", "f"], [10, 10, 10, 10])
    assert _merge_ranges(["b", "d", "f"], [10, 10, 10, 10], 2) == (["d"], [20, 20])
    assert _merge_ranges(["b", "d", "f"], [10, 10, 10, 10], 1) == ([], [40])
    bounds, counts = _merge_ranges(list(range(1, 8)), [5, 1, 1, 1, 5, 1, 1, 1], 3)
    assert sum(counts) == 16 and len(counts) == 3 and len(bounds) == 2 and bounds == sorted(bounds)
    # Exact quantiles give ranges a few rows either side of equal: a cut goes at the boundary
    # nearest its share, so eight ranges of about 25,000 make four of about 50,000, never
    # 75k + 50k + 50k + 25k (one of two workers idle for a quarter of the run).
    counts8 = [24_990, 25_010, 24_980, 25_020, 24_995, 25_005, 24_999, 25_001]
    bounds, counts = _merge_ranges(list(range(1, 8)), counts8, 4)
    assert bounds == [2, 4, 6] and counts == [50_000, 50_000, 50_000, 50_000]
    bounds, counts = _merge_ranges(list(range(1, 8)), [25_010, 24_990, *counts8[2:]], 4)
    assert bounds == [2, 4, 6] and counts == [50_000, 50_000, 50_000, 50_000]
    # Every range left must become a shard of its own: the cuts still come out as many as wanted.
    assert _merge_ranges(["b", "d", "f"], [1, 1, 1, 97], 3) == (["d", "f"], [2, 1, 97])
    assert _merge_ranges(["b", "d", "f"], [97, 1, 1, 1], 3) == (["b", "d"], [97, 1, 2])
