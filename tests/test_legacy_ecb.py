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
from typing import Any, Protocol

import psycopg
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from pinrotate_core import rotation
from pinrotate_core.config import Settings
from pinrotate_core.gate import retire_gate
from pinrotate_core.schemes.fpc1_values import parse_fpc1

from .test_fpc1_migration import K2, custom_settings, legacy_ecb, unecb, write_keys

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
        self.values = {i: legacy_ecb(p, self.legacy_key, "AES") for i, p in self.genuine.items()}
        self.values |= {i: legacy_ecb(p, foreign_key, "AES") for i, p in foreign_plain.items()}
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
        s = custom_settings(database_url, keys_file, {"table": "creds", "columns": ["pw"], "legacy_algorithm": "AES"},
                            **keys)
        return s.model_copy(update={"job": s.job.model_copy(update={"batch_size": 200})})

    def stored(self) -> dict[int, str | None]:
        return {int(r[0]): None if r[1] is None else str(r[1]) for r in self.conn.execute("SELECT id, pw FROM creds")}

    def clear_foreign(self) -> None:
        """What a person does about the foreign values: takes them out."""
        self.conn.execute("UPDATE creds SET pw = NULL WHERE id > %s", (GENUINE,))


class DataSet(Protocol):
    """``creds`` as above, on either engine (test_legacy_ecb_mysql makes it on MariaDB)."""

    foreign_ids: list[int]
    genuine: dict[int, bytes]
    padding_only: list[int]
    utf8_too: list[int]

    def stored(self) -> dict[int, str | None]: ...

    def clear_foreign(self) -> None: ...


def test_foreign_ecb_values_hold_back_every_legacy_value_and_keep_the_legacy_gate_closed(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    data = EcbDataSet(pg_conn)
    assert_all_or_nothing_per_key(data, data.settings(database_url, keys_file))


def assert_all_or_nothing_per_key(data: DataSet, settings: Settings) -> None:
    """Every legacy value held back while foreign ones fail, the legacy gate closed; the genuine ones
    moved to what Forge reads once a person has cleared the foreign ones."""
    # The trap is real in this data set: some foreign values pass the padding check; none is UTF-8.
    assert len(data.padding_only) >= 1 and data.utf8_too == []
    before = data.stored()

    deep = rotation.inventory(settings, deep=True).targets["T"]
    assert deep.counts["LEGACY"] == GENUINE + FOREIGN
    assert deep.counts["FAILED"] == FOREIGN and deep.failed_by_key == {"legacy": FOREIGN}

    dry = rotation.run_rotation(settings, dry_run=True)
    report = rotation.run_rotation(settings, expected_key="k2")

    assert report.exit_code == rotation.EXIT_FAIL_CLOSED == dry.exit_code
    result = report.targets["T"]
    # All or nothing per key: not one legacy value is rewritten, the genuine ones included.
    assert result.reencrypted == 0 == dry.targets["T"].reencrypted and result.conflicts == 0
    assert result.counts["key_held"] == GENUINE
    assert [(int(f.id), f.reason) for f in result.failed] == [(i, "decrypt_failed") for i in data.foreign_ids]
    assert data.stored() == before  # byte-identical, every row

    gate = rotation.retire_gate(settings, "legacy")  # the engine's gate, as `gate --retire` asks it
    assert not gate.open and gate.blocking["FAILED"] == FOREIGN and gate.blocking["LEGACY"] == GENUINE + FOREIGN

    # Once the foreign values are dealt with by a person, the genuine ones move, to what Forge reads.
    data.clear_foreign()
    again = rotation.run_rotation(settings, expected_key="k2")
    assert again.exit_code == 0 and again.targets["T"].reencrypted == GENUINE
    after = data.stored()
    for i, plaintext in data.genuine.items():
        stored = after[i]
        assert stored is not None
        value = parse_fpc1(stored)
        assert (value.algorithm, value.key_id) == ("AES", "k2") and unecb("AES", K2, value.payload) == plaintext


def test_inventory_deep_and_the_run_read_ecb_values_the_same_way(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    data = EcbDataSet(pg_conn)
    settings = data.settings(database_url, keys_file)
    deep = rotation.inventory(settings, deep=True).targets["T"]
    dry = rotation.run_rotation(settings, dry_run=True).targets["T"]
    assert deep.counts["FAILED"] == len(dry.failed)


def test_with_legacy_reading_off_legacy_values_are_left_alone_and_not_held_against_the_run(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    data = EcbDataSet(pg_conn)
    settings = data.settings(database_url, keys_file, legacy_read_enabled=False)
    before = data.stored()
    report = rotation.run_rotation(settings, expected_key="k2")
    result = report.targets["T"]
    assert report.exit_code == rotation.EXIT_OK and result.failed == []
    assert result.legacy_left == GENUINE + FOREIGN and result.reencrypted == 0
    assert data.stored() == before
    assert not retire_gate(settings, "legacy").open
