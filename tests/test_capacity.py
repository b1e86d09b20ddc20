"""Room for the new ciphertexts: a real ``varchar(n)`` column, never a truncated value.

The capacity check runs for every scheme before anything is written (inventory and gate: BLOCKED;
``run``: refused, exit 2). Behind it, the drain's own writes never cast to a length-limited type,
so a value too long for its column is a database error that rolls the whole batch back: the tests
that bypass the check (a scheme drained directly) prove that no value is ever shortened.
Transit values grow when the key version gains a digit (``vault:v9:`` -> ``vault:v10:``): the
OpenBao key is really rotated from version 9 to 10. All keys are random TEST keys.
"""

from __future__ import annotations

import base64
import secrets
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.db import raw_connection
from pinrotate_core.drain import STOP_DB_ERROR, Drain, DrainOptions, DrainResult
from pinrotate_core.errors import ConfigError
from pinrotate_core.gate import retire_gate
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.schemes.registry import build_scheme
from pinrotate_core.schemes.transit import transit_version
from pinrotate_core.targets import resolve_target

from .helpers import make_keyring
from .test_fpc1_migration import K1, custom_settings, fpc1, legacy_ecb, write_keys
from .test_transit_drain import new_transit, transit
from .transit_helpers import transit_decrypt, transit_encrypt


def drain_without_capacity_check(settings: Settings, expected_key: str | None = None) -> DrainResult:
    """The run's steps up to the drain, but the scheme bound directly (``resolve_all``, which
    refuses a target too narrow, is skipped): what the drain's SQL does on its own."""
    ctx = rotation.open_run(settings, expected_key=expected_key)
    try:
        keyring = rotation.read_current_key(ctx, announce=False)
        with raw_connection(ctx.engine) as conn:
            scheme = build_scheme(resolve_target(conn, settings.targets[0]), keyring, settings.keys, ctx.provider)
        return Drain(ctx.engine, scheme, DrainOptions(batch_size=100)).run()
    finally:
        ctx.close()


def rows_of(conn: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    return conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()


# --- vault-transit: v9 -> v10 ------------------------------------------------------------------------


def transit_settings(database_url: str, server: Any, mount: str, key: str) -> Settings:
    return settings_from_mapping({
        "database": {"url": database_url},
        "keys": {"provider": "vault-transit",
                 "vault": {"addr": server.addr, "token": server.token, "transit_mount": mount, "key": key}},
        "job": {"batch_size": 100, "inter_batch_delay": 0},
        "targets": [{"name": "Notes", "table": "notes", "id": "id", "columns": ["body"], "format": "vault-transit"}],
    }, env={})


@pytest.mark.vault
def test_transit_values_that_gain_a_version_digit_block_a_tight_varchar_and_are_never_truncated(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    while provider.current_version() < 9:
        provider.rotate()
    full = [f"note {i:03d} of a fixed length".encode() for i in range(5)]
    short = b"short"
    values = transit_encrypt(provider, [*full, short])
    assert {transit_version(v) for v in values} == {9}
    width = len(values[0])
    assert {len(v) for v in values[:5]} == {width} and len(values[5]) < width - 1
    pg_conn.execute(f"CREATE TABLE notes (id bigint PRIMARY KEY, body varchar({width}))")
    pg_conn.cursor().executemany("INSERT INTO notes VALUES (%s, %s)", list(enumerate(values, 1)))
    assert provider.rotate() == 10  # every value now needs one character more: vault:v10:
    settings = transit_settings(database_url, openbao, mount, key)
    before = rows_of(pg_conn, "notes")

    inv = rotation.inventory(settings).targets["Notes"]
    assert inv.counts["BLOCKED"] == 1
    assert inv.blocked_reason == (f"column body is character varying({width}), too narrow: re-encrypted under key 10 "
                                  f"its values need up to {width + 1} characters (widen it; pinrotate never changes the application's schema)")
    gate = retire_gate(settings, "9")
    assert not gate.open and gate.blocking["BLOCKED"] == 1
    for dry_run in (False, True):
        with pytest.raises(ConfigError, match=r"target Notes: column body is .*too narrow.*nothing was touched"):
            rotation.run_rotation(settings, dry_run=dry_run)
    assert rows_of(pg_conn, "notes") == before

    # Past the check, the database itself refuses the longer values: the whole batch rolls back,
    # the short value that would have fitted included, and nothing is shortened.
    result = drain_without_capacity_check(settings)
    assert result.stopped == STOP_DB_ERROR and result.reencrypted == 0
    assert "StringDataRightTruncation, SQLSTATE 22001" in (result.error or "")  # value too long for its type
    assert rows_of(pg_conn, "notes") == before

    # One character more and the same values fit: nothing BLOCKED, everything on v10, read back.
    pg_conn.execute(f"ALTER TABLE notes ALTER COLUMN body TYPE varchar({width + 1})")
    assert rotation.inventory(settings).targets["Notes"].counts["BLOCKED"] == 0
    report = rotation.run_rotation(settings)
    assert report.exit_code == rotation.EXIT_OK and report.targets["Notes"].reencrypted == 6
    after = [r[1] for r in rows_of(pg_conn, "notes")]
    assert {transit_version(v) for v in after} == {10}
    assert [len(v) for v in after] == [len(v) + 1 for v in values]
    assert transit_decrypt(provider, after) == [*full, short]
    assert retire_gate(settings, "9").open


# --- fpc1: legacy -> FPC1 grows the value -------------------------------------------------------------


def test_fpc1_values_too_long_for_their_column_roll_the_batch_back_when_the_check_is_bypassed(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    pg_conn.execute("CREATE TABLE creds (id bigint PRIMARY KEY, pw varchar(70))")
    # 40 bytes of plaintext: 64 characters as legacy, 76 once FPC1:SM4 under k2. Row 2 would fit.
    pg_conn.execute("INSERT INTO creds VALUES (1, %s), (2, %s)", (legacy_ecb(b"x" * 40), fpc1("k1", K1, b"short")))
    write_keys(keys_file)
    settings = custom_settings(database_url, keys_file, {"table": "creds", "columns": ["pw"]})
    before = rows_of(pg_conn, "creds")

    result = drain_without_capacity_check(settings, expected_key="k2")

    assert result.stopped == STOP_DB_ERROR and result.reencrypted == 0 and result.conflicts == 0
    assert "StringDataRightTruncation, SQLSTATE 22001" in (result.error or "")  # value too long for its type
    assert rows_of(pg_conn, "creds") == before


# --- aesgcm: the length never changes ------------------------------------------------------------------


def test_aesgcm_base64_text_keeps_its_length_so_an_exactly_full_varchar_is_not_blocked(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    keyring = make_keyring("1", "2", current="1")
    ciphers = AesGcmCipherSet(keyring)
    plaintexts = [secrets.token_bytes(n) for n in (0, 1, 30, 31, 32)]
    values = [base64.b64encode(ciphers.encrypt_current(p)).decode() for p in plaintexts]
    width = max(len(v) for v in values)
    pg_conn.execute(f"CREATE TABLE secrets (id bigint PRIMARY KEY, key_version int, body varchar({width}))")
    pg_conn.cursor().executemany("INSERT INTO secrets VALUES (%s, 1, %s)", list(enumerate(values, 1)))
    keys_file.write_text('current = 2\n[keys]\n' + "".join(
        f'{k} = "{base64.b64encode(v.material).decode()}"\n' for k, v in keyring.keys.items()), encoding="utf-8")
    keys_file.chmod(0o600)
    settings = settings_from_mapping({
        "database": {"url": database_url}, "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": 100, "inter_batch_delay": 0},
        "targets": [{"name": "S", "table": "secrets", "id": "id", "key_version": "key_version",
                     "columns": ["body"], "format": "aesgcm"}]}, env={})

    assert rotation.inventory(settings).targets["S"].counts["BLOCKED"] == 0
    report = rotation.run_rotation(settings)

    assert report.exit_code == rotation.EXIT_OK and report.targets["S"].reencrypted == 5
    after = rows_of(pg_conn, "secrets")
    assert [len(r[2]) for r in after] == [len(v) for v in values] and {r[1] for r in after} == {2}
    assert [ciphers.decrypt("2", base64.b64decode(r[2])) for r in after] == plaintexts
