"""Unauthenticated legacy values (``legacy_format = "aes-ecb-b64"``) on real PostgreSQL.

ECB has no tag: a value written under some other key passes the PKCS#7 padding check about once in
256 tries. With ``legacy_plaintext = "utf8"`` (the default) such a value must also decrypt to UTF-8
text, or it is FAILED and never rewritten. The data set is deterministic (seeded TEST keys), and
the test works out on its own, with the raw cipher, which foreign values pass the padding check,
so that it proves the point on values that really do.
"""

from __future__ import annotations

import base64
import random
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from pinrotate_core import rotation
from pinrotate_core.config import Settings
from pinrotate_core.gate import retire_gate
from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.schemes.fpc1_values import Fpc1CipherSet, parse_fpc1

from .test_fpc1_migration import K1, K2, custom_settings, legacy_ecb, write_keys

SEED = 9_2024
GENUINE = 20
FOREIGN = 1000


def padding_passes(value: str, key: bytes) -> bytes | None:
    """The plaintext when ``value`` decrypts under ``key`` with valid PKCS#7 padding, else None."""
    dec = Cipher(algorithms.AES(key), modes.ECB()).decryptor()
    padded = dec.update(base64.b64decode(value)) + dec.finalize()
    unpadder = padding.PKCS7(128).unpadder()
    try:
        return unpadder.update(padded) + unpadder.finalize()
    except ValueError:
        return None


def is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class EcbDataSet:
    """``creds``: GENUINE values under the legacy key, then FOREIGN values under another service's key."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        rng = random.Random(SEED)
        self.legacy_key, foreign_key = rng.randbytes(32), rng.randbytes(32)
        self.genuine = {i: f"пароль {i} {rng.randbytes(6).hex()}".encode() for i in range(1, GENUINE + 1)}
        foreign_plain = {i: f"other service {i}: {rng.randbytes(rng.randrange(1, 20)).hex()}".encode()
                         for i in range(GENUINE + 1, GENUINE + FOREIGN + 1)}
        self.values = {i: legacy_ecb(p, self.legacy_key) for i, p in self.genuine.items()}
        self.values |= {i: legacy_ecb(p, foreign_key) for i, p in foreign_plain.items()}
        self.foreign_ids = sorted(foreign_plain)
        conn.execute("CREATE TABLE creds (id bigint PRIMARY KEY, pw text)")
        conn.cursor().executemany("INSERT INTO creds VALUES (%s, %s)", sorted(self.values.items()))
        self.conn = conn
        # Foreign values the padding check alone would take for legacy values under our key.
        opened = {i: padding_passes(self.values[i], self.legacy_key) for i in self.foreign_ids}
        self.padding_only = sorted(i for i, p in opened.items() if p is not None)
        self.utf8_too = sorted(i for i, p in opened.items() if p is not None and is_utf8(p))

    def settings(self, database_url: str, keys_file: Path, **keys: Any) -> Settings:
        write_keys(keys_file, legacy=self.legacy_key)
        s = custom_settings(database_url, keys_file, {"table": "creds", "columns": ["pw"]},
                            legacy_format="aes-ecb-b64", **keys)
        return s.model_copy(update={"job": s.job.model_copy(update={"batch_size": 200})})

    def stored(self) -> dict[int, str]:
        return {int(r[0]): str(r[1]) for r in self.conn.execute("SELECT id, pw FROM creds")}


def test_foreign_ecb_values_are_failed_never_rewritten_and_keep_the_legacy_gate_closed(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    data = EcbDataSet(pg_conn)
    # The trap is real in this data set: some foreign values pass the padding check; none is UTF-8.
    assert len(data.padding_only) >= 1 and data.utf8_too == []
    settings = data.settings(database_url, keys_file)
    assert settings.keys.legacy_plaintext == "utf8"  # the default

    deep = rotation.inventory(settings, deep=True).targets["T"]
    assert deep.counts["LEGACY"] == GENUINE + FOREIGN
    assert deep.counts["FAILED"] == FOREIGN and deep.failed_by_key == {"legacy": FOREIGN}

    report = rotation.run_rotation(settings, expected_key="k2")

    assert report.exit_code == rotation.EXIT_FAIL_CLOSED
    result = report.targets["T"]
    assert result.reencrypted == GENUINE and result.conflicts == 0
    assert [(int(f.id), f.reason) for f in result.failed] == [(i, "decrypt_failed") for i in data.foreign_ids]
    after = data.stored()
    assert {i: after[i] for i in data.foreign_ids} == {i: data.values[i] for i in data.foreign_ids}  # byte-identical
    ring = Keyring(current="k2", keys={"k1": Key("k1", K1), "k2": Key("k2", K2)}, source="test",
                   legacy=Key("legacy", data.legacy_key))
    ciphers = Fpc1CipherSet(ring)
    for i, plaintext in data.genuine.items():
        assert parse_fpc1(after[i]).key_id == "k2" and ciphers.decrypt(after[i]) == plaintext

    deep = rotation.inventory(settings, deep=True).targets["T"]
    assert (deep.counts["ACTIVE"], deep.counts["LEGACY"], deep.counts["FAILED"]) == (GENUINE, FOREIGN, FOREIGN)
    gate = retire_gate(settings, "legacy")
    assert not gate.open and gate.blocking["FAILED"] == FOREIGN and gate.blocking["LEGACY"] == FOREIGN


def test_legacy_plaintext_bytes_trusts_the_padding_alone(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    """Documented behaviour of ``legacy_plaintext = "bytes"`` (binary plaintexts): every value with
    valid padding counts as decrypted, foreign ones included; a run would rewrite them as garbage."""
    data = EcbDataSet(pg_conn)
    settings = data.settings(database_url, keys_file, legacy_plaintext="bytes")
    before = data.stored()

    deep = rotation.inventory(settings, deep=True).targets["T"]
    assert deep.counts["FAILED"] == FOREIGN - len(data.padding_only)

    dry = rotation.run_rotation(settings, dry_run=True)
    assert dry.targets["T"].reencrypted == GENUINE + len(data.padding_only)
    assert sorted(int(f.id) for f in dry.targets["T"].failed) == sorted(set(data.foreign_ids) - set(data.padding_only))
    assert data.stored() == before


@pytest.mark.parametrize("mode", ["utf8", "bytes"])
def test_inventory_deep_and_the_run_read_ecb_values_the_same_way(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, mode: str) -> None:
    data = EcbDataSet(pg_conn)
    settings = data.settings(database_url, keys_file, legacy_plaintext=mode)
    deep = rotation.inventory(settings, deep=True).targets["T"]
    dry = rotation.run_rotation(settings, dry_run=True).targets["T"]
    assert deep.counts["FAILED"] == len(dry.failed)
