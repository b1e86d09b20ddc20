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
from typing import Any

from psycopg import sql

from .._primitives import AesGcm, random_nonces
from ..errors import CiphertextInvalid, KeyUnavailable, VerificationFailed
from ..keyring import Keyring, is_version
from ..targets import Column, ResolvedTarget
from .base import UNKNOWN_VALUE, BatchPlan, FailedRow, RowLocked, ValueClass, Write

__all__ = ["AesGcmCipherSet", "AesGcmScheme", "ColumnEncoding", "classify_version", "plan_aesgcm_batch",
           "random_nonces"]


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

    def reencrypt_into_current(self, key_id: str, blobs: list[bytes], nonces: list[bytes] | None = None) -> list[bytes]:
        """Re-encrypt values of one key under the current key, each verified (see AesGcm.reencrypt_into).

        Raises CiphertextInvalid for the first value that does not decrypt.
        """
        source = self.cipher(key_id)
        target = self.cipher(self.keyring.current)
        nonces = random_nonces(len(blobs)) if nonces is None else nonces
        return [source.reencrypt_into(target, blob, nonce) for blob, nonce in zip(blobs, nonces)]


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
    """
    write = Write(tuple(range(len(columns))))
    plan = BatchPlan(writes=[write])
    ids, new_columns = write.ids, write.new  # filled directly: this loop is the drain's hot path
    current = ciphers.keyring.current
    target_cipher = ciphers.cipher(current)
    raw = [enc is ColumnEncoding.BYTEA for enc in encodings]
    nonces = random_nonces(len(rows) * len(columns))
    n = 0
    for row in rows:
        row_id = row[0]
        if known_failed and str(row_id) in known_failed:
            plan.skipped += 1
            continue
        source = ciphers.cipher(str(row[1]))  # KeyUnavailable here: the whole batch rolls back
        new_row: list[Any] = []
        bad: list[str] = []
        for j, stored in enumerate(row[2:]):
            if stored is None:
                new_row.append(None)
                continue
            nonce = nonces[n]
            n += 1
            try:
                blob = stored if raw[j] else encodings[j].to_bytes(stored)
                fresh = source.reencrypt_into(target_cipher, blob, nonce)
            except CiphertextInvalid:
                bad.append(columns[j])
                continue
            except VerificationFailed:
                raise KeyUnavailable(
                    f"target {target}: a value re-encrypted under key {current} did not verify", retryable=False
                ) from None
            new_row.append(fresh if raw[j] else encodings[j].from_bytes(fresh))
        if bad:
            plan.failed.append(FailedRow(target, str(row_id), tuple(bad)))
            continue
        ids.append(row_id)
        for values, value in zip(new_columns, new_row):
            values.append(value)
    write.weights = [1] * len(ids)
    write.tenants = [""] * len(ids)
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


class AesGcmScheme(RowLocked):
    """``aesgcm`` bound to one target and the run's keyring (see the module docstring)."""

    name = "aesgcm"

    def __init__(self, target: ResolvedTarget, keyring: Keyring) -> None:
        assert target.key_version is not None, "aesgcm targets are validated to have key_version"
        self.target = target
        self.keyring = keyring
        self.current = keyring.current_version
        self.current_key = keyring.current
        self.ciphers = AesGcmCipherSet(keyring)
        self.encodings = tuple(ColumnEncoding.for_column(c) for c in target.columns)
        self._kv = target.key_version

    def _ident(self, column: str, alias: str | None) -> sql.Identifier:
        return sql.Identifier(alias, column) if alias else sql.Identifier(column)

    def stale_condition(self, alias: str | None = None) -> sql.Composable:
        # "<" never selects a row on a newer key (key rolled back), and never a NULL key version.
        return sql.SQL("{} < {}").format(self._ident(self._kv.name, alias), sql.Literal(self.current))

    def read_list(self, alias: str | None = None) -> list[sql.Composable]:
        return [self._ident(self._kv.name, alias), *(self._ident(c.name, alias) for c in self.target.columns)]

    def key_version_column(self) -> Column | None:
        return self._kv

    def plan(self, rows: Sequence[Sequence[Any]], known_failed: Collection[str] = ()) -> BatchPlan:
        return plan_aesgcm_batch(self.target.name, self.target.settings.columns, self.encodings, rows, self.ciphers,
                                 known_failed=known_failed)

    def value_keys_sql(self, alias: str) -> list[tuple[sql.Composable, sql.Composable]] | None:
        return [(sql.SQL("{}::text").format(self._ident(self._kv.name, alias)), sql.SQL("true"))]

    def classify_key(self, key: str | None) -> ValueClass:
        return classify_version(key, self.keyring)

    def inspect(self, row: Sequence[Any], deep: bool) -> Iterator[tuple[ValueClass, bool]]:
        key = None if row[0] is None else str(row[0])
        value = self.classify_key(key)
        failed = False
        if deep and key is not None and key in self.keyring.keys:
            for enc, stored in zip(self.encodings, row[1:]):
                if stored is None:
                    continue
                try:
                    self.ciphers.decrypt(key, enc.to_bytes(stored))
                except CiphertextInvalid:
                    failed = True
                    break
        yield value, failed

    def growth(self, column: Column) -> int:
        return 0  # GCM keeps the length; base64 of the same number of bytes too

    def length_after(self, column: Column, stored: Any) -> int | None:
        return len(stored)
