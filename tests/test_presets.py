"""The Pin profile preset: its schema applies (twice), its config loads, its seeder fills it right.

Runs on every database fixture server (embedded, and PostgreSQL 15 when
PINROTATE_TEST_EXTRA_DATABASE_URL is set). Plaintexts are recomputed from the seed, not stored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from psycopg import sql

from pinrotate_core.config import load_settings
from pinrotate_core.errors import ConfigError, KeyUnavailable
from pinrotate_core.keyring import Keyring
from pinrotate_core.samples import pin_profile as presets
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet

from .helpers import make_keyring

# xdist: every test of this module on one worker (one database per server for the module).
pytestmark = pytest.mark.xdist_group("test_presets")

if TYPE_CHECKING:
    from .conftest import PgServer

Conn = psycopg.Connection[Any]
TABLES = [f"profile.{t}" for t in presets.TABLES]


def count(conn: Conn, table: str, where: str = "true") -> int:
    schema, name = table.split(".")
    query = sql.SQL("SELECT count(*) FROM {} WHERE {}").format(sql.Identifier(schema, name), sql.SQL(where))
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def decrypt_table(conn: Conn, keyring: Keyring, table: str) -> dict[Any, tuple[int | None, dict[str, bytes | None]]]:
    """Every row of a preset table: id -> (key_version, {cipher column: plaintext or None})."""
    columns = presets.CIPHER_COLUMNS[table]
    ciphers = AesGcmCipherSet(keyring)
    query = sql.SQL("SELECT id, key_version, {} FROM {}").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.Identifier("profile", table))
    out: dict[Any, tuple[int | None, dict[str, bytes | None]]] = {}
    for row_id, key_version, *values in conn.execute(query):
        out[row_id] = (key_version, {
            c: None if v is None else ciphers.decrypt(str(key_version), bytes(v)) for c, v in zip(columns, values)
        })
    return out


@pytest.fixture(scope="module")
def module_database_url(pg_server: PgServer) -> Iterator[str]:
    # One database per server for this module: CREATE DATABASE costs far more than DROP SCHEMA.
    with pg_server.fresh_database() as url:
        yield url


@pytest.fixture
def empty_db(module_database_url: str) -> Iterator[Conn]:
    """An autocommit connection to a database with no ``profile`` schema."""
    with psycopg.connect(module_database_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS profile CASCADE")
        yield conn


@pytest.fixture
def profile_db(empty_db: Conn) -> Conn:
    presets.apply_pin_profile_schema(empty_db)
    return empty_db


def test_the_schema_applies_twice_without_error_or_change(empty_db: Conn) -> None:
    pg_conn = empty_db
    presets.apply_pin_profile_schema(pg_conn)
    shape = pg_conn.execute(
        "SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns"
        " WHERE table_schema = 'profile' ORDER BY table_name, ordinal_position").fetchall()
    presets.apply_pin_profile_schema(pg_conn)
    again = pg_conn.execute(
        "SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns"
        " WHERE table_schema = 'profile' ORDER BY table_name, ordinal_position").fetchall()
    assert shape == again
    assert {r[0] for r in shape} == set(presets.TABLES)
    assert all(count(pg_conn, t) == 0 for t in TABLES)


def test_every_preset_table_has_a_uuid_key_and_untouchable_audit_columns(profile_db: Conn) -> None:
    rows = profile_db.execute(
        "SELECT table_name, column_name, data_type, is_nullable, column_default FROM information_schema.columns"
        " WHERE table_schema = 'profile'").fetchall()
    cols = {(t, c): (dtype, nullable, default) for t, c, dtype, nullable, default in rows}
    for table in presets.TABLES:
        assert cols[(table, "id")][0] == "uuid"
        assert cols[(table, "version")][:2] == ("integer", "NO") and cols[(table, "version")][2] == "1"
        assert cols[(table, "updated_at")][:2] == ("timestamp with time zone", "NO")
        assert cols[(table, "updated_by_user_id")][0] == "uuid"
        assert cols[(table, "key_version")][0] == "integer"
        for column in presets.CIPHER_COLUMNS[table]:
            assert cols[(table, column)][0] == "bytea"
    assert cols[("persons", "first_name_cipher")][1] == "NO"
    assert cols[("persons", "middle_name_cipher")][1] == "YES"
    assert cols[("person_documents", "number_hash")][:2] == ("bytea", "NO")
    assert cols[("person_documents", "number_mask")][:2] == ("text", "NO")
    assert cols[("verification_requests", "key_version")][1] == "YES"


def test_a_snapshot_without_key_version_or_the_reverse_is_refused(profile_db: Conn) -> None:
    for snapshot, key_version in ((b"x" * 40, None), (None, 1)):
        with pytest.raises(psycopg.errors.CheckViolation):
            profile_db.execute(
                "INSERT INTO profile.verification_requests (id, person_id, status, snapshot_cipher, key_version)"
                " VALUES (gen_random_uuid(), gen_random_uuid(), 'submitted', %s, %s)", (snapshot, key_version))


def test_the_example_config_loads_and_names_columns_of_the_preset_schema(profile_db: Conn) -> None:
    settings = load_settings(presets.PIN_PROFILE_TOML, env={})
    assert [t.name for t in settings.targets] == ["Person", "PersonDocument", "RequisiteTemplate",
                                                   "VerificationRequest"]
    assert settings.database.url is None
    assert settings.keys.provider == "file"
    by_name = {t.name: t for t in settings.targets}
    assert by_name["VerificationRequest"].require_not_null == ("snapshot_cipher",)
    for target, table in zip(settings.targets, presets.TABLES):
        assert target.table == f"profile.{table}"
        assert target.format == "aesgcm" and target.key_version == "key_version" and target.id == "id"
        assert target.columns == presets.CIPHER_COLUMNS[table]
        found = {r[0] for r in profile_db.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = 'profile'"
            " AND table_name = %s", (table,))}
        assert set(target.columns) | {"id", "key_version"} <= found


def test_seeding_creates_the_expected_counts_drafts_and_nulls(profile_db: Conn) -> None:
    ring = make_keyring("1")
    summary = presets.seed_pin_profile(profile_db, ring, rows=120, seed=11)
    assert summary.counts == {"profile.persons": 120, "profile.person_documents": 60,
                              "profile.requisite_templates": 30, "profile.verification_requests": 30}
    for table, n in summary.counts.items():
        assert count(profile_db, table) == n
    assert summary.total_rows == 240
    # Drafts: a third of requests, with neither snapshot nor key version nor submission time.
    assert summary.drafts == 10
    assert count(profile_db, "profile.verification_requests",
                 "status = 'draft' AND snapshot_cipher IS NULL AND key_version IS NULL AND submitted_at IS NULL") == 10
    assert count(profile_db, "profile.verification_requests",
                 "status = 'submitted' AND snapshot_cipher IS NOT NULL AND key_version = 1"
                 " AND submitted_at IS NOT NULL") == 20
    # Persons: every name, half the middle names, 70% of birth dates; all on key 1.
    assert count(profile_db, "profile.persons", "key_version = 1") == 120
    assert count(profile_db, "profile.persons", "middle_name_cipher IS NULL") == 60
    assert count(profile_db, "profile.persons", "birth_date_cipher IS NOT NULL") == 84
    # Templates: a quarter with no contact at all (still on key 1), a quarter each with one.
    assert count(profile_db, "profile.requisite_templates",
                 "contact_email_cipher IS NULL AND contact_phone_cipher IS NULL AND key_version = 1") == 8
    assert count(profile_db, "profile.requisite_templates",
                 "(contact_email_cipher IS NULL) <> (contact_phone_cipher IS NULL)") == 15
    assert count(profile_db, "profile.person_documents", "key_version = 1") == 60


def test_every_seeded_cipher_decrypts_under_key_1_to_its_deterministic_plaintext(profile_db: Conn) -> None:
    ring = make_keyring("1")
    summary = presets.seed_pin_profile(profile_db, ring, rows=200, seed=42)
    expected = presets.expected_plaintexts(rows=200, seed=42)
    assert summary.expected_plaintexts() == expected
    for table in presets.TABLES:
        stored = decrypt_table(profile_db, ring, table)
        assert set(stored) == set(expected[table])
        for row_id, plaintexts in expected[table].items():
            key_version, decrypted = stored[row_id]
            assert decrypted == plaintexts, f"{table} {row_id}"
            drafted = table == presets.VERIFICATION_REQUESTS and plaintexts["snapshot_cipher"] is None
            assert key_version == (None if drafted else 1)


def test_plaintexts_are_synthetic_and_recognisable() -> None:
    expected = presets.expected_plaintexts(rows=8, seed=3, first_row=120)
    person = next(iter(expected[presets.PERSONS].values()))
    assert person["first_name_cipher"] == b"First-000120"
    assert person["last_name_cipher"] == b"Last-000120"
    payloads = [p["payload_cipher"] for p in expected[presets.PERSON_DOCUMENTS].values()]
    assert all(json.loads(p or b"")["issued_by"].startswith("Synthetic Authority") for p in payloads)
    emails = [p["contact_email_cipher"] for p in expected[presets.REQUISITE_TEMPLATES].values()]
    assert {e for e in emails if e} == {b"user000121@example.test"}


def test_document_mask_and_hash_follow_the_encrypted_number(profile_db: Conn) -> None:
    ring = make_keyring("1")
    presets.seed_pin_profile(profile_db, ring, rows=20, seed=5)
    ciphers = AesGcmCipherSet(ring)
    hashes = set()
    for payload, mask, number_hash in profile_db.execute(
            "SELECT payload_cipher, number_mask, number_hash FROM profile.person_documents"):
        doc = json.loads(ciphers.decrypt("1", payload))
        assert mask == "******" + (doc["series"] + doc["number"])[-4:]
        assert len(number_hash) == 32
        hashes.add(bytes(number_hash))
    assert len(hashes) == 10


def test_audit_columns_are_seeded_distinct_per_row(profile_db: Conn) -> None:
    presets.seed_pin_profile(profile_db, make_keyring("1"), rows=40, seed=9)
    for table in TABLES:
        n = count(profile_db, table)
        row = profile_db.execute(sql.SQL(
            "SELECT count(DISTINCT updated_at), count(DISTINCT updated_by_user_id), count(DISTINCT version) FROM {}"
        ).format(sql.Identifier(*table.split(".")))).fetchone()
        assert row is not None
        assert row[0] == n and row[1] == n and row[2] == min(n, 5)


def test_seeding_again_past_the_first_rows_adds_rows_under_another_key(profile_db: Conn) -> None:
    ring = make_keyring("1", "2")
    first = presets.seed_pin_profile(profile_db, ring, rows=40, key_id="1", seed=7)
    second = presets.seed_pin_profile(profile_db, ring, rows=40, key_id="2", seed=7, first_row=40)
    assert count(profile_db, "profile.persons") == 80
    assert count(profile_db, "profile.persons", "key_version = 2") == 40
    assert count(profile_db, "profile.verification_requests", "key_version = 2") == 40 // 4 - second.drafts
    for summary in (first, second):
        expected = summary.expected_plaintexts()
        for table in presets.TABLES:
            stored = decrypt_table(profile_db, ring, table)
            for row_id, plaintexts in expected[table].items():
                assert stored[row_id][1] == plaintexts


def test_the_same_seed_gives_the_same_ids_and_another_seed_other_ids() -> None:
    a = presets.expected_plaintexts(rows=12, seed=1)
    assert a == presets.expected_plaintexts(rows=12, seed=1)
    b = presets.expected_plaintexts(rows=12, seed=2)
    for table in presets.TABLES:
        assert not set(a[table]) & set(b[table])
    assert all(row_id.version == 4 for row_id in a[presets.PERSONS])


def test_seeding_with_a_key_the_keyring_lacks_inserts_nothing(profile_db: Conn) -> None:
    with pytest.raises(KeyUnavailable):
        presets.seed_pin_profile(profile_db, make_keyring("1"), rows=10, key_id="2")
    with pytest.raises(ConfigError):
        presets.seed_pin_profile(profile_db, make_keyring("1"), rows=10, key_id="k1")
    assert all(count(profile_db, t) == 0 for t in TABLES)


def test_a_seed_of_zero_rows_inserts_nothing(profile_db: Conn) -> None:
    summary = presets.seed_pin_profile(profile_db, make_keyring("1"), rows=0, seed=1)
    assert summary.total_rows == 0 and summary.drafts == 0
    assert all(count(profile_db, t) == 0 for t in TABLES)


def test_seeding_a_few_thousand_rows_round_trips(profile_db: Conn) -> None:
    ring = make_keyring("3", current="3")
    summary = presets.seed_pin_profile(profile_db, ring, rows=4000, key_id="3")
    assert count(profile_db, "profile.persons", "key_version = 3") == 4000
    expected = summary.expected_plaintexts()
    stored = decrypt_table(profile_db, ring, presets.PERSONS)
    assert {k: v[1] for k, v in stored.items()} == expected[presets.PERSONS]
