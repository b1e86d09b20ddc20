"""The row-versioned ``aesgcm`` format: nonce(12) || ciphertext || tag(16), no associated data.

A 32-byte key is AES-256-GCM, a 16-byte key AES-128-GCM. In a ``bytea`` column the raw bytes, in a
text column standard base64 (with padding) of the same bytes.
"""

from __future__ import annotations

import base64
import binascii
import enum

from .._primitives import AesGcm, random_nonces
from ..errors import CiphertextInvalid
from ..keyring import Keyring

__all__ = ["AesGcmCipherSet", "ColumnEncoding", "random_nonces"]


class ColumnEncoding(enum.Enum):
    BYTEA = "bytea"
    BASE64_TEXT = "base64-text"

    @classmethod
    def for_sql_type(cls, data_type: str) -> ColumnEncoding:
        return cls.BYTEA if data_type == "bytea" else cls.BASE64_TEXT

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

        Raises CiphertextInvalid for the first value that does not decrypt; callers that must
        isolate bad values pass one row at a time.
        """
        source = self.cipher(key_id)
        target = self.cipher(self.keyring.current)
        nonces = random_nonces(len(blobs)) if nonces is None else nonces
        return [source.reencrypt_into(target, blob, nonce) for blob, nonce in zip(blobs, nonces)]
