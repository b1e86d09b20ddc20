"""A scheme added from the test suite alone: ``register`` is all it needs of pinrotate_core.

``toy-gcm`` is a TEST-ONLY format, never a real one: text values ``TOY:<base64(nonce || ct || tag)>``
(AES-GCM from ``cryptography``), every value of a row under the key its integer key-version column
names (as ``aesgcm``), rows locked while read and written (the row-lock guard of ``schemes.base``).
Inventory, dry run, run and the retire gate then work on it against real PostgreSQL, as they do on
the built-in schemes. Keys are random TEST keys made here.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pinrotate_core import rotation
from pinrotate_core.config import KeysSettings, Settings, settings_from_mapping
from pinrotate_core.engines.base.operations import Operations
from pinrotate_core.errors import CiphertextInvalid, ConfigError, TargetBlocked, VerificationFailed
from pinrotate_core.gate import retire_gate
from pinrotate_core.keyring import Keyring
from pinrotate_core.schemes import FormatRules, known_formats
from pinrotate_core.schemes.aesgcm import classify_version
from pinrotate_core.schemes.base import BatchPlan, FailedRow, IntegerVersions, RowVersioned, ValueClass, Write
from pinrotate_core.schemes.registry import register, scheme_class
from pinrotate_core.targets import Column, ResolvedTarget

from .test_scope_matrix import write_keys_file

TOY = "toy-gcm"  # TEST ONLY
PREFIX = "TOY:"


def seal(key: bytes, plaintext: bytes) -> str:
    nonce = secrets.token_bytes(12)
    return PREFIX + base64.b64encode(nonce + AESGCM(key).encrypt(nonce, plaintext, None)).decode()


def unseal(key: bytes, value: str) -> bytes:
    try:
        blob = base64.b64decode(value.removeprefix(PREFIX), validate=True)
        if not value.startswith(PREFIX) or len(blob) < 28:
            raise CiphertextInvalid("not a toy value")
        return AESGCM(key).decrypt(blob[:12], blob[12:], None)
    except (binascii.Error, InvalidTag):
        raise CiphertextInvalid("not a toy value") from None


class ToyScheme(IntegerVersions, RowVersioned):
    """TEST ONLY. Integer key versions (``IntegerVersions``: NEWER above current), the row lock."""

    name: ClassVar[str] = TOY

    def __init__(self, target: ResolvedTarget, keyring: Keyring, keys: KeysSettings, provider: object = None) -> None:
        if target.key_version is None or any(c.type_name != "text" for c in target.columns):
            raise TargetBlocked(target.name, "toy values live in text columns beside a key-version column")
        self.target, self.keyring, self.kv = target, keyring, target.key_version
        self.current_key = keyring.current

    # Its SQL is composed of the engine's pieces (quoting, casts), never written for one engine.
    def stale_condition(self, ops: Operations, alias: str | None = None) -> str:
        return f"{ops.column(self.kv.name, alias)} < {int(self.current_key)}"

    def read_list(self, ops: Operations, alias: str | None = None) -> list[str]:
        return [ops.column(self.kv.name, alias), *(ops.column(c.name, alias) for c in self.target.columns)]

    def key_version_column(self) -> Column | None:
        return self.kv

    def plan(self, rows: Sequence[Sequence[Any]], known_failed: Collection[str] = ()) -> BatchPlan:
        write = Write(tuple(range(len(self.target.columns))))
        plan = BatchPlan(writes=[write])
        current = self.keyring.key(self.current_key).material
        for row in rows:
            if str(row[0]) in known_failed:
                plan.skipped += 1
                continue
            old = self.keyring.key(str(row[1])).material  # KeyUnavailable: the drain rolls the batch back
            try:
                plain = [None if v is None else unseal(old, v) for v in row[2:]]
            except CiphertextInvalid:
                plan.failed.append(FailedRow(self.target.name, str(row[0]), self.target.settings.columns))
                continue
            new = [None if p is None else seal(current, p) for p in plain]
            if [None if v is None else unseal(current, v) for v in new] != plain:
                raise VerificationFailed("a toy value did not read back")
            write.add(row[0], new)
        return plan

    def value_keys_sql(self, ops: Operations, alias: str) -> list[tuple[str, str]] | None:
        return [(ops.text_of(ops.column(self.kv.name, alias)), "TRUE")]

    def classify_key(self, key: str | None) -> ValueClass:
        return classify_version(key, self.keyring)

    def inspect(self, row: Sequence[Any], deep: bool) -> Iterator[tuple[ValueClass, bool]]:
        value = self.classify_key(None if row[0] is None else str(row[0]))
        failed = False
        if deep and value.key in self.keyring.keys:
            try:
                for stored in row[1:]:
                    if stored is not None:
                        unseal(self.keyring.key(str(value.key)).material, stored)
            except CiphertextInvalid:
                failed = True
        yield value, failed

    def growth(self, column: Column) -> int:
        return 0

    def length_after(self, column: Column, stored: Any) -> int | None:
        return len(stored)


@pytest.fixture(scope="module", autouse=True)
def toy_registered() -> None:
    register(ToyScheme, FormatRules(needs_key_version=True))


def toy_world(conn: psycopg.Connection[Any], url: str, keys_file: Path) -> tuple[Settings, dict[str, bytes],
                                                                                  dict[int, bytes]]:
    """Keys 1 and 2 (current) and 3 (added, not yet current); rows 1-7 on key 1, 8-9 on key 2, 10 on key 3."""
    material = {k: secrets.token_bytes(32) for k in ("1", "2", "3")}
    write_keys_file(keys_file, "2", material)
    conn.execute("CREATE TABLE toy (id bigint PRIMARY KEY, key_version int, name_cipher text, note_cipher text)")
    plain = {i: f"person {i} ".encode() + secrets.token_bytes(4) for i in range(1, 11)}
    for i, p in plain.items():
        key = "1" if i <= 7 else "2" if i <= 9 else "3"
        conn.execute("INSERT INTO toy VALUES (%s, %s, %s, %s)",
                     (i, int(key), seal(material[key], p), None if i == 4 else seal(material[key], p + b" note")))
    settings = settings_from_mapping({
        "database": {"url": url}, "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": 3, "inter_batch_delay": 0},
        "targets": [{"name": "Toy", "table": "toy", "key_version": "key_version",
                     "columns": ["name_cipher", "note_cipher"], "format": TOY}]}, env={})
    return settings, material, plain


def test_a_scheme_registered_from_outside_the_core_runs_inventory_dry_run_run_and_gate(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    settings, material, plain = toy_world(pg_conn, database_url, keys_file)
    before = pg_conn.execute("SELECT * FROM toy ORDER BY id").fetchall()

    inv = rotation.inventory(settings).targets["Toy"]
    assert (inv.format, inv.counts["HISTORICAL"], inv.counts["ACTIVE"], inv.counts["NEWER"]) == (TOY, 7, 2, 1)
    assert inv.by_key == {"1": 7, "2": 2, "3": 1} and inv.counts["BLOCKED"] == 0
    assert not retire_gate(settings, "1").open

    dry = rotation.run_rotation(settings, dry_run=True)
    assert dry.exit_code == 0 and dry.targets["Toy"].reencrypted == 7
    assert pg_conn.execute("SELECT * FROM toy ORDER BY id").fetchall() == before  # a dry run writes nothing

    report = rotation.run_rotation(settings)
    assert report.exit_code == 0 and report.targets["Toy"].reencrypted == 7
    assert report.gate["1"]["open"] and not report.gate["3"]["open"]
    rows = pg_conn.execute("SELECT id, key_version, name_cipher, note_cipher FROM toy ORDER BY id").fetchall()
    for row_id, version, name, note in rows:
        key = material[str(version)]
        assert version == (3 if row_id == 10 else 2)  # never downgraded from the newer key
        assert unseal(key, name) == plain[row_id]
        assert (note is None) == (row_id == 4) and (note is None or unseal(key, note) == plain[row_id] + b" note")
    assert rows[0][2] != before[0][2]  # moved to key 2, same plaintext

    after = rotation.inventory(settings, deep=True).targets["Toy"]
    assert (after.counts["ACTIVE"], after.counts["HISTORICAL"], after.counts["FAILED"]) == (9, 0, 0)
    gate = retire_gate(settings, "1")
    assert gate.open and not any(gate.blocking.values())
    newer = retire_gate(settings, "3")  # the gate asks the toy's class for its key order: NEWER
    assert not newer.open and newer.blocking["NEWER"] == 1


def test_a_format_nobody_registered_is_refused_naming_every_known_one(database_url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        settings_from_mapping({"database": {"url": database_url}, "targets": [
            {"name": "T", "table": "t", "key_version": "kv", "columns": ["c"], "format": "rot13"}]}, env={})
    assert str(refused.value).startswith("configuration: target \"T\": format: not a known format (known: "
                                         f"{', '.join(known_formats())})")
    assert {"aesgcm", "fpc1", "vault-transit", TOY} <= set(known_formats())


def test_the_registered_toy_rules_reach_the_settings_and_a_name_is_never_taken_twice() -> None:
    with pytest.raises(ConfigError, match="target \"T\": a toy-gcm target needs key_version"):
        settings_from_mapping({"targets": [{"name": "T", "table": "t", "columns": ["c"], "format": TOY}]}, env={})

    class Impostor(ToyScheme):
        pass

    with pytest.raises(ConfigError, match="format toy-gcm is registered already"):
        register(Impostor)
    assert scheme_class(TOY) is ToyScheme


def test_every_format_the_settings_know_has_a_scheme_class() -> None:
    assert all(scheme_class(name).name == name for name in known_formats())
