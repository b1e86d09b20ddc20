"""The retire gate never opens wrongly (issue 9): keys the keyring does not hold and the current key
are refused with exit 2, and an open answer waits until what it read is flushed to the WAL.

Real PostgreSQL and a real OpenBao; keys are random TEST keys made here.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import settings_from_mapping
from pinrotate_core.engines.postgresql.durability import confirm_flushed, wait_for_flush
from pinrotate_core.errors import ConfigError, DatabaseError
from pinrotate_core.gate import KeyNotRetirable, retire_gate
from tests.pinprofile import cli, seed_profile

from .helpers import b64
from .test_targets import PEOPLE, ROWS, create_people, settings_for
from .test_transit_drain import new_transit, seed_people, transit
from .test_transit_drain import settings_for as transit_settings
from .vault_server import BaoAdmin


def lsn_at_least(conn: psycopg.Connection[Any], a: str, b: str) -> bool:
    row = conn.execute("SELECT %s::pg_lsn >= %s::pg_lsn", (a, b)).fetchone()
    return bool(row and row[0])


# -- keys the keyring does not hold, and the current key ------------------------------------------------


def test_gate_refuses_keys_the_file_keyring_does_not_hold_and_names_those_it_holds(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    create_people(pg_conn, keys_file)
    settings = settings_for(database_url, keys_file, triggers="fire")
    for key in ("99", "abc", "0", "02", "legacy"):
        with pytest.raises(KeyNotRetirable) as refused:
            retire_gate(settings, key)
        message = str(refused.value)
        assert message.startswith(f"key {key} is not in the keyring") and message.endswith(f"{keys_file} holds 1, 2")
        assert "\n" not in message
    with pytest.raises(KeyNotRetirable, match="no legacy key is configured"):
        retire_gate(settings, "legacy")
    with pytest.raises(KeyNotRetirable, match=r"^key 2 is the current key; promote another key first$"):
        retire_gate(settings, "2")
    assert issubclass(KeyNotRetirable, ConfigError)  # exit code 2
    assert not retire_gate(settings, "1").open  # a key it holds: answered, closed (rows on it)


def test_the_current_key_is_refused_even_on_an_empty_table(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    create_people(pg_conn, keys_file)
    pg_conn.execute("DELETE FROM people")
    settings = settings_for(database_url, keys_file)
    with pytest.raises(KeyNotRetirable, match="key 2 is the current key"):
        retire_gate(settings, "2")
    assert retire_gate(settings, "1").open  # nothing references key 1 any more


def test_fpc1_key_ids_and_the_legacy_key_are_checked_against_the_keyring(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    pg_conn.execute("CREATE TABLE secrets (id bigint PRIMARY KEY, secret text)")
    keys = {"k1": secrets.token_bytes(16), "k2025": secrets.token_bytes(16)}
    body = 'current = "k2025"\n[keys]\n' + "".join(f'{k} = "{b64(v)}"\n' for k, v in keys.items())
    keys_file.write_text(body, encoding="utf-8")
    keys_file.chmod(0o600)
    raw = {"database": {"url": database_url}, "keys": {"provider": "file", "file": str(keys_file)},
           "targets": [{"name": "S", "table": "secrets", "columns": ["secret"], "format": "fpc1"}]}
    settings = settings_from_mapping(raw, env={})
    for key, why in (("k3", ""), ("1", ""), ("legacy", " (no legacy key is configured)")):
        with pytest.raises(KeyNotRetirable, match=rf"^key {key} is not in the keyring{'.*' if why else ''}; "
                                                  rf"file .* holds k1, k2025$"):
            retire_gate(settings, key)
    with pytest.raises(KeyNotRetirable, match="^key k2025 is the current key; promote another key first$"):
        retire_gate(settings, "k2025")
    assert retire_gate(settings, "k1").open

    keys_file.write_text(f'legacy = "{b64(secrets.token_bytes(32))}"\n' + body, encoding="utf-8")
    assert retire_gate(settings, "legacy").open  # now held, and no legacy value is left


def test_env_keyring_ids_are_what_the_environment_holds(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    create_people(pg_conn, keys_file)
    ring = rotation.build_provider(settings_for(database_url, keys_file)).load_keyring()
    monkeypatch.setenv("PINROTATE_KEY_CURRENT", "2")
    for key_id in ("1", "2"):
        monkeypatch.setenv(f"PINROTATE_KEY_{key_id}", b64(ring.key(key_id).material))
    settings = settings_for(database_url, keys_file).model_copy(
        update={"keys": settings_for(database_url, keys_file).keys.model_copy(update={"provider": "env"})})
    with pytest.raises(KeyNotRetirable, match=r"^key 3 is not in the keyring; env PINROTATE_KEY_\* holds 1, 2$"):
        retire_gate(settings, "3")
    with pytest.raises(KeyNotRetirable, match="key 2 is the current key"):
        retire_gate(settings, "2")


@pytest.mark.vault
def test_a_transit_keyring_holds_the_versions_transit_still_decrypts(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    seed_people(pg_conn, provider, 6, phases=2)  # values on v1 and v2; latest is v3
    settings = transit_settings(database_url, openbao, mount, key)
    assert not retire_gate(settings, "1").open and not retire_gate(settings, "2").open
    with pytest.raises(KeyNotRetirable, match="^key 3 is the current key; rotate the Transit key first$"):
        retire_gate(settings, "3")
    for missing in ("4", "0", "abc", "legacy"):
        with pytest.raises(KeyNotRetirable, match=f"^key {missing} is not in the keyring.*holds versions 1 to 3$"):
            retire_gate(settings, missing)

    assert rotation.run_rotation(settings).exit_code == 0
    assert retire_gate(settings, "1").open
    BaoAdmin.of(openbao).api("POST", f"{mount}/keys/{key}/config", {"min_decryption_version": 2})
    # Retired in Transit: no longer a version it holds (what `keys` lists in its read answer).
    with pytest.raises(KeyNotRetirable, match="key 1 is not in the keyring; vault-transit .* holds versions 2 to 3"):
        retire_gate(settings, "1")
    assert retire_gate(settings, "2").open


def test_cli_gate_refusals_are_exit_2_with_one_line_and_one_json_document(
        primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=4)
    cases = {"99": "key 99 is not in the keyring; file ",
             "2": "key 2 is the current key; promote another key first"}
    for key, expected in cases.items():
        code, doc, err = cli("gate", "--retire", key, "--config", str(profile.config_path), "--json")
        assert code == 2, err
        assert set(doc) == {"error", "exit_code"} and doc["exit_code"] == 2
        assert doc["error"].startswith(expected) and "\n" not in doc["error"]
        assert "Traceback" not in err and err.strip().count("\n") == 0
    code, out, err = cli("gate", "--retire", "legacy", "--config", str(profile.config_path))
    assert code == 2 and out == "" and "no legacy key is configured" in err and "holds 1, 2" in err


# -- an open gate stands on flushed WAL ---------------------------------------------------------------------


def test_an_open_gate_waits_until_the_wal_behind_what_it_read_is_flushed(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    create_people(pg_conn, keys_file)
    settings = settings_for(database_url, keys_file)
    assert rotation.run_rotation(settings).exit_code == 0
    # A last asynchronous commit, as a batch of another run would make it, just before the gate reads.
    with pg_conn.transaction():
        pg_conn.execute("SET LOCAL synchronous_commit = off")
        pg_conn.execute("UPDATE people SET note = 'seen by the gate' WHERE id = 1")
    row = pg_conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    after_commit = str(row[0])

    report = retire_gate(settings, "1")

    assert report.open
    durability = report.as_dict()["durability"]
    assert durability["flushed"] is True
    # It compared a position at or after that commit with the flush position, and waited for it.
    assert lsn_at_least(pg_conn, durability["wal_insert_lsn"], after_commit)
    assert lsn_at_least(pg_conn, durability["wal_flush_lsn"], durability["wal_insert_lsn"])
    assert json.loads(json.dumps(report.as_dict()))["durability"] == durability


def test_a_closed_gate_needs_no_wait_and_records_none(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    create_people(pg_conn, keys_file)
    report = retire_gate(settings_for(database_url, keys_file), "1")
    assert not report.open and report.blocking["HISTORICAL"] == ROWS and "durability" not in report.as_dict()
    assert report.targets[PEOPLE]["on_key"] == ROWS


def test_wal_that_never_gets_flushed_fails_the_gate_closed(pg_conn: psycopg.Connection[Any]) -> None:
    # A position far beyond anything written: even a forced flush cannot reach it.
    row = pg_conn.execute("SELECT (pg_current_wal_insert_lsn() + 1073741824)::text").fetchone()
    assert row is not None
    with pytest.raises(DatabaseError, match="is not flushed after .*the gate does not answer") as failed:
        wait_for_flush(pg_conn, str(row[0]), timeout=0.2)
    assert "\n" not in str(failed.value)
    reached = confirm_flushed(pg_conn)  # the real insert position is reached, by a forced flush if need be
    assert reached["flushed"] and lsn_at_least(pg_conn, reached["wal_flush_lsn"], reached["wal_insert_lsn"])
