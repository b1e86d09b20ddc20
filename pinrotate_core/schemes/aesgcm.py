"""The row-versioned ``aesgcm`` scheme: nonce(12) || ciphertext || tag(16), no associated data.

A 32-byte key is AES-256-GCM, a 16-byte key AES-128-GCM. In a ``bytea`` column the raw bytes, in a
text column standard base64 (with padding) of the same bytes. Every cipher column of a row is
under the key named by the row's integer key-version column; rows with ``key_version < current``
are stale, rows above current (a key rolled back) are never touched. Counts rows.
"""

from __future__ import annotations

import base64
import binascii
import enum
from collections.abc import Collection, Iterator, Sequence
from typing import Any, ClassVar

from .._primitives import AesGcm
from ..config import KeysSettings
from ..engines.base.operations import Operations
from ..errors import CiphertextInvalid, KeyUnavailable, TargetBlocked, VerificationFailed
from ..keyring import Keyring, is_version
from ..targets import Column, ResolvedTarget
from .base import UNKNOWN_VALUE, BatchPlan, FailedRow, IntegerVersions, RowVersioned, ValueClass, Write

__all__ = ["AesGcmCipherSet", "AesGcmScheme", "ColumnEncoding", "classify_version", "plan_aesgcm_batch"]


class ColumnEncoding(enum.Enum):
    BYTEA = "bytea"
    BASE64_TEXT = "base64-text"

    @classmethod
    def for_column(cls, column: Column) -> ColumnEncoding:
        return cls.BYTEA if column.type_name == "bytea" else cls.BASE64_TEXT

    def to_bytes(self, stored: bytes | str | memoryview) -> bytes:
        if self is ColumnEncoding.BYTEA:
            return bytes(stored) if not isinstance(stored, str) else stored.encode()
        text = stored if isinstance(stored, str) else bytes(stored).decode("ascii", "replace")
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise CiphertextInvalid("value is not valid base64") from None

    def from_bytes(self, blob: bytes) -> bytes | str:
        if self is ColumnEncoding.BYTEA:
            return blob
        return base64.b64encode(blob).decode("ascii")


class AesGcmCipherSet:
    """One AES-GCM object per key of the keyring, built once per run (not per value)."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self._ciphers: dict[str, AesGcm] = {}

    def cipher(self, key_id: str) -> AesGcm:
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            # KeyUnavailable propagates: a missing key is a provider failure, not a bad row.
            cipher = AesGcm(self.keyring.key(key_id).material)
            self._ciphers[key_id] = cipher
        return cipher

    def decrypt(self, key_id: str, blob: bytes) -> bytes:
        return self.cipher(key_id).decrypt(blob)

    def encrypt_current(self, plaintext: bytes, nonce: bytes | None = None) -> bytes:
        return self.cipher(self.keyring.current).encrypt(plaintext, nonce)


def plan_aesgcm_batch(
    target: str,
    columns: Sequence[str],
    encodings: Sequence[ColumnEncoding],
    rows: Sequence[Sequence[Any]],
    ciphers: AesGcmCipherSet,
    *,
    known_failed: Collection[str] = (),
) -> BatchPlan:
    """Re-encrypt ``rows`` = ``(id, key_version, *cipher_columns)`` under the current key.

    A key missing from the keyring raises KeyUnavailable (the caller rolls the whole batch back);
    a value that does not decrypt marks its row FAILED and leaves it unchanged. NULL stays NULL.
    The plan has one write: every cipher column of every row that moves.

    The drain's hot path: the batch is worked column by column and key by key (a batch's rows are
    nearly always on one key), so that the per-value Python is the three AEAD calls of
    ``AesGcm.reencrypt_many`` and little else.
    """
    write = Write(tuple(range(len(columns))))
    plan = BatchPlan(writes=[write])
    given: list[int] | None = None  # positions of ``rows`` in the rows given, where some were left out
    if known_failed:
        given = [i for i, row in enumerate(rows) if str(row[0]) not in known_failed]
        plan.skipped = len(rows) - len(given)
        rows = [rows[i] for i in given]
    current = ciphers.keyring.current
    target_cipher = ciphers.cipher(current)
    versions = [row[1] for row in rows]
    # Rows by key: one group (every row, in order) in the common case.
    groups: list[tuple[Any, list[int] | None]]
    if not rows or versions.count(versions[0]) == len(versions):
        groups = [(versions[0], None)] if rows else []
    else:
        by_key: dict[Any, list[int]] = {}
        for i, version in enumerate(versions):
            by_key.setdefault(version, []).append(i)
        groups = list(by_key.items())
    sources = [(ciphers.cipher(str(version)), positions) for version, positions in groups]  # KeyUnavailable: roll back
    bad_columns: dict[int, list[str]] = {}  # row position -> columns that did not decrypt
    new_columns: list[list[Any]] = []
    for j, encoding in enumerate(encodings):
        stored = [row[2 + j] for row in rows]
        if encoding is ColumnEncoding.BYTEA:
            blobs: list[bytes | None] = stored
        else:
            blobs = []
            for i, value in enumerate(stored):
                try:
                    blobs.append(None if value is None else encoding.to_bytes(value))
                except CiphertextInvalid:
                    blobs.append(None)
                    bad_columns.setdefault(i, []).append(columns[j])
        new: list[Any] = [None] * len(rows) if len(sources) > 1 else []
        for source, positions in sources:
            part = blobs if positions is None else [blobs[i] for i in positions]
            try:
                fresh, bad = source.reencrypt_many(target_cipher, part)
            except VerificationFailed:
                raise KeyUnavailable(
                    f"target {target}: a value re-encrypted under key {current} did not verify", retryable=False
                ) from None
            for k in bad:
                bad_columns.setdefault(k if positions is None else positions[k], []).append(columns[j])
            written: list[Any] = fresh if encoding is ColumnEncoding.BYTEA else [
                None if v is None else encoding.from_bytes(v) for v in fresh]
            if positions is None:
                new = written
            else:
                for k, i in enumerate(positions):
                    new[i] = written[k]
        new_columns.append(new)
    if not bad_columns:
        write.ids = [row[0] for row in rows]
        write.new = new_columns
        write.rows = given if plan.skipped else None
    else:
        keep = [i for i in range(len(rows)) if i not in bad_columns]
        for i in sorted(bad_columns):
            named = set(bad_columns[i])
            plan.failed.append(FailedRow(target, str(rows[i][0]), tuple(c for c in columns if c in named)))
        write.ids = [rows[i][0] for i in keep]
        write.new = [[values[i] for i in keep] for values in new_columns]
        write.rows = keep if given is None else [given[i] for i in keep]
    write.weights = [1] * len(write.ids)
    write.tenants = [""] * len(write.ids)
    return plan


def classify_version(key_id: str | None, keyring: Keyring) -> ValueClass:
    """ACTIVE / HISTORICAL / NEWER / UNKNOWN_KEY for a value on integer key version ``key_id``."""
    if key_id is None or not is_version(key_id):
        return UNKNOWN_VALUE  # in scope, but no key version to read it with
    if key_id not in keyring.keys and not keyring.server_side:
        return ValueClass("UNKNOWN_KEY", key_id)
    current = keyring.current_version
    v = int(key_id)
    return ValueClass("ACTIVE" if v == current else ("HISTORICAL" if v < current else "NEWER"), key_id)


class AesGcmScheme(IntegerVersions, RowVersioned):
    """``aesgcm`` bound to one target and the run's keyring (see the module docstring)."""

    name: ClassVar[str] = "aesgcm"

    def __init__(self, target: ResolvedTarget, keyring: Keyring, keys: KeysSettings, provider: object = None) -> None:
        assert target.key_version is not None, "aesgcm targets are validated to have key_version"
        if any(c.type_name in ("json", "jsonb") for c in target.columns):
            raise TargetBlocked(target.name, "aesgcm cipher columns must be bytea or text")
        self.target = target
        self.keyring = keyring
        self.current = keyring.current_version
        self.current_key = keyring.current
        self.ciphers = AesGcmCipherSet(keyring)
        self.encodings = tuple(ColumnEncoding.for_column(c) for c in target.columns)
        self._kv = target.key_version
        self._to_bytes = tuple(e.to_bytes for e in self.encodings)
        self._all_bytea = all(e is ColumnEncoding.BYTEA for e in self.encodings)
        self._seen: dict[Any, tuple[ValueClass, str | None]] = {}  # key version -> (class, held key)

    def stale_condition(self, ops: Operations, alias: str | None = None) -> str:
        # "<" never selects a row on a newer key (key rolled back), and never a NULL key version.
        return f"{ops.column(self._kv.name, alias)} < {int(self.current)}"

    def read_list(self, ops: Operations, alias: str | None = None) -> list[str]:
        return [ops.column(self._kv.name, alias), *(ops.column(c.name, alias) for c in self.target.columns)]

    def key_version_column(self) -> Column | None:
        return self._kv

    def plan(self, rows: Sequence[Sequence[Any]], known_failed: Collection[str] = ()) -> BatchPlan:
        return plan_aesgcm_batch(self.target.name, self.target.settings.columns, self.encodings, rows, self.ciphers,
                                 known_failed=known_failed)

    def value_keys_sql(self, ops: Operations, alias: str) -> list[tuple[str, str]] | None:
        return [(ops.text_of(ops.column(self._kv.name, alias)), "TRUE")]

    def classify_key(self, key: str | None) -> ValueClass:
        return classify_version(key, self.keyring)

    def inspect(self, row: Sequence[Any], deep: bool) -> Iterator[tuple[ValueClass, bool]]:
        # Called for every row of a deep inventory (1M rows: 4M values): the class of a key version
        # is looked up once, and each value costs one AEAD call.
        seen = self._seen.get(row[0])
        if seen is None:
            key = None if row[0] is None else str(row[0])
            seen = self._seen[row[0]] = (self.classify_key(key), key if key in self.keyring.keys else None)
        value, held = seen
        failed = False
        if deep and held is not None:
            if self._all_bytea:  # read in binary: the values are the blobs
                failed = not self.ciphers.cipher(held).reads_all(row[1:])
            else:
                try:
                    blobs = [to_bytes(v) for to_bytes, v in zip(self._to_bytes, row[1:]) if v is not None]
                except CiphertextInvalid:  # not even base64
                    failed = True
                else:
                    failed = not self.ciphers.cipher(held).reads_all(blobs)
        yield value, failed

    def growth(self, column: Column) -> int:
        return 0  # GCM keeps the length; base64 of the same number of bytes too

    def length_after(self, column: Column, stored: Any) -> int | None:
        return len(stored)
