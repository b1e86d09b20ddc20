"""What the database stored is read back and compared, every row of every batch, on a real
PostgreSQL. With ``triggers = "fire"``, a BEFORE UPDATE trigger that keeps a field's old value (an
"immutable field" rule) makes some rows store something other than the new ciphertext: each such
row is rolled back within its batch and left as it was, whole (its key version still names the key
of its value), FAILED; the batch's other rows stand, and no gate opens, the run's included. A
generated cipher column is BLOCKED at the start. A batch whose COMMIT outcome is unknown (the
connection lost during COMMIT) is reported as such, never as rolled back, and the backlog recounted. Keys are random TEST keys made here.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.errors import ConfigError
from pinrotate_core.keyring import Keyring
from pinrotate_core.metrics import RotationMetrics
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.schemes.base import NOT_STORED
from pinrotate_core.schemes.fpc1_values import parse_fpc1

from .test_fpc1_migration import DC, Forge, decrypt, forge_settings, write_keys

ROWS = 200
KEPT = 25  # every 25th row's trigger keeps its old value: 8 rows


def settings(url: str, keys_file: Path, table: str = "people") -> Settings:
    return settings_from_mapping({
        "database": {"url": url},
        "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": 64, "inter_batch_delay": 0},
        "gate": {"wait": 1},
        "targets": [{"name": "People", "table": table, "key_version": "key_version", "columns": ["name_cipher"],
                     "triggers": "fire"}],
    }, env={})


def people_on_key_1(conn: psycopg.Connection[Any], keys_file: Path) -> Keyring:
    provider = FileKeyProvider(keys_file, create=True)
    ciphers = AesGcmCipherSet(provider.load_keyring())
    conn.execute("CREATE TABLE people (id bigint PRIMARY KEY, key_version integer NOT NULL, name_cipher bytea)")
    with conn.transaction():
        conn.cursor().executemany("INSERT INTO people VALUES (%s, 1, %s)",
                                  [(i, ciphers.encrypt_current(f"TEST name {i}".encode())) for i in range(1, ROWS + 1)])
    provider.add_key()
    provider.promote("2")
    return provider.load_keyring()


def every_row(conn: psycopg.Connection[Any], keyring: Keyring) -> dict[int, tuple[int, str]]:
    """id -> (key version, plaintext) of every row, decrypted with the key its key version names."""
    ciphers = AesGcmCipherSet(keyring)
    out: dict[int, tuple[int, str]] = {}
    for i, kv, blob in conn.execute("SELECT id, key_version, name_cipher FROM people"):
        try:
            out[i] = (kv, ciphers.cipher(str(kv)).decrypt(bytes(blob)).decode())
        except Exception:  # noqa: BLE001 - a value its key version cannot decrypt is what the test looks for
            out[i] = (kv, "<does not decrypt with the key its version names>")
    return out


def test_a_trigger_keeping_the_old_value_fails_its_rows_the_others_stand_and_no_gate_opens(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    keyring = people_on_key_1(pg_conn, keys_file)
    pg_conn.execute(f"""
        CREATE FUNCTION keep_name() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.id % {KEPT} = 0 THEN NEW.name_cipher := OLD.name_cipher; END IF;
            RETURN NEW;
        END $$""")
    pg_conn.execute("CREATE TRIGGER name_is_immutable BEFORE UPDATE ON people FOR EACH ROW EXECUTE FUNCTION keep_name()")
    report = rotation.run_rotation(settings(database_url, keys_file))
    kept = [i for i in range(1, ROWS + 1) if i % KEPT == 0]
    assert every_row(pg_conn, keyring) == {
        i: ((1 if i in kept else 2), f"TEST name {i}") for i in range(1, ROWS + 1)}
    result = report.targets["People"]
    assert sorted((int(f.id), f.reason) for f in result.failed) == [(i, NOT_STORED) for i in kept]
    assert result.reencrypted == ROWS - len(kept)
    assert report.exit_code == 4
    assert report.gate and not any(v.get("open") for v in report.gate.values()), report.gate
    metrics = RotationMetrics()
    rotation.record_metrics(report, metrics)
    # Each row stored otherwise is a db_error (contract §7's reasons), besides a stop of the target.
    errors = metrics.registry.get_sample_value("profile_crypto_reencrypt_errors_total", {"reason": "db_error"})
    assert errors == len(kept) + (1 if result.stopped == "db_error" else 0)


@pytest.mark.parametrize(("column", "kind"), [("name_cipher", "generated"), ("key_version", "generated"),
                                              ("key_version", "identity")])
def test_a_generated_or_identity_always_cipher_or_key_version_column_is_blocked_at_the_start(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, column: str, kind: str) -> None:
    FileKeyProvider(keys_file, create=True).load_keyring()
    kv = {"generated": "integer GENERATED ALWAYS AS (1) STORED",
          "identity": "integer GENERATED ALWAYS AS IDENTITY"}[kind] if column == "key_version" else "integer NOT NULL"
    name = "bytea GENERATED ALWAYS AS (decode('00', 'hex')) STORED" if column == "name_cipher" else "bytea"
    pg_conn.execute(f"CREATE TABLE people_generated (id bigint PRIMARY KEY, key_version {kv}, name_cipher {name})")
    ctx = rotation.open_run(settings(database_url, keys_file, "people_generated"), target_names=["People"])
    try:
        rotation.read_current_key(ctx)
        with pytest.raises(ConfigError, match=f"column {column} of people_generated is an? {kind} column"):
            rotation.resolve_all(ctx)
    finally:
        ctx.close()


def test_a_connection_lost_during_commit_is_reported_as_unknown_not_rolled_back_and_the_backlog_recounted(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    # A deferred constraint trigger runs at COMMIT: for the batch holding row 100 it sleeps there,
    # and the drain's backend is terminated in the middle of its COMMIT.
    people_on_key_1(pg_conn, keys_file)
    pg_conn.execute("""
        CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_sleep(30); RETURN NULL; END $$""")
    pg_conn.execute("CREATE CONSTRAINT TRIGGER slow_commit AFTER UPDATE ON people DEFERRABLE INITIALLY DEFERRED"
                    " FOR EACH ROW WHEN (NEW.id = 100) EXECUTE FUNCTION slow_commit()")
    errors: list[BaseException] = []

    def terminate_the_commit() -> None:
        try:
            with psycopg.connect(database_url, autocommit=True) as admin:
                deadline = time.monotonic() + 60
                while not admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                        " WHERE application_name = 'pinrotate' AND wait_event = 'PgSleep'").fetchall():
                    assert time.monotonic() < deadline, "the drain's COMMIT never reached the trigger"
                    time.sleep(0.02)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    killer = threading.Thread(target=terminate_the_commit, daemon=True)
    killer.start()
    report = rotation.run_rotation(settings(database_url, keys_file))
    killer.join(60)
    assert not errors, errors
    result = report.targets["People"]
    assert result.stopped == "db_error" and report.exit_code == 4
    assert result.error and "outcome of a batch's COMMIT is unknown" in result.error and "rolled back" not in result.error
    assert any("COMMIT outcome is unknown" in note for note in result.notes)
    stale = pg_conn.execute("SELECT count(*) FROM people WHERE key_version <> 2").fetchone()
    assert stale is not None and result.backlog_remaining == stale[0] > 0


def test_fpc1_a_trigger_keeping_the_old_value_fails_that_row_and_the_others_move(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    # The compare-and-swap guard (fpc1) reads back what was stored the same way.
    forge = Forge(pg_conn)
    write_keys(keys_file)
    before = forge.password(2)
    pg_conn.execute("""
        CREATE FUNCTION keep_password() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.id = 2 THEN NEW.password := OLD.password; END IF;
            RETURN NEW;
        END $$""")
    pg_conn.execute("CREATE TRIGGER password_is_immutable BEFORE UPDATE ON data_connections"
                    " FOR EACH ROW EXECUTE FUNCTION keep_password()")
    settings = forge_settings(database_url, keys_file)
    settings = settings.model_copy(update={"targets": [
        t.model_copy(update={"triggers": "fire"}) if t.name == DC else t for t in settings.targets]})
    report = rotation.run_rotation(settings, target_names=[DC], expected_key="k2")
    result = report.targets[DC]
    assert [(f.id, f.reason) for f in result.failed] == [("2", NOT_STORED)]
    assert forge.password(2) == before  # left as it was, on k1
    for row_id in (1, 4, 7):  # legacy and k1 values moved, each with its own plaintext
        value = forge.password(row_id)
        assert value is not None and decrypt(value) == forge.plain[("dc", row_id, "password")]
        assert parse_fpc1(value).key_id == "k2"
    assert report.exit_code == 4 and not any(v.get("open") for v in report.gate.values())
