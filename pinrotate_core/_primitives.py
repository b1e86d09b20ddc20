"""Raw cipher primitives, all from ``cryptography``. Private: only the schemes and key_checks import this.

Nothing here knows about keyrings, columns or databases; nothing here ever logs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hmac, padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import CiphertextInvalid, VerificationFailed

NONCE_LEN = 12
TAG_LEN = 16


def random_nonce() -> bytes:
    return os.urandom(NONCE_LEN)


class AesGcm:
    """nonce(12) || ciphertext || tag(16), AES-GCM, no associated data. One object per key."""

    __slots__ = ("_aead",)

    def __init__(self, key: bytes) -> None:
        if len(key) not in (16, 24, 32):
            raise ValueError("AES-GCM key must be 16, 24 or 32 bytes")
        self._aead = AESGCM(key)

    def encrypt(self, plaintext: bytes, nonce: bytes | None = None) -> bytes:
        nonce = random_nonce() if nonce is None else nonce
        return nonce + self._aead.encrypt(nonce, plaintext, None)

    def decrypt(self, blob: bytes) -> bytes:
        if len(blob) < NONCE_LEN + TAG_LEN:
            raise CiphertextInvalid("ciphertext too short")
        try:
            return self._aead.decrypt(blob[:NONCE_LEN], blob[NONCE_LEN:], None)
        except InvalidTag:
            raise CiphertextInvalid("ciphertext does not authenticate") from None

    def reads_all(self, blobs: Sequence[bytes | None]) -> bool:
        """Whether every blob (None: no value) decrypts under this key: the deep inventory's check
        of one row, one call for all its values and no exception per bad value."""
        decrypt = self._aead.decrypt
        try:
            for blob in blobs:
                if blob is None:
                    continue
                if len(blob) < NONCE_LEN + TAG_LEN:
                    return False
                decrypt(blob[:NONCE_LEN], blob[NONCE_LEN:], None)
        except InvalidTag:
            return False
        return True

    def reencrypt_many(self, target: AesGcm, blobs: Sequence[bytes | None]) -> tuple[list[bytes | None], list[int]]:
        """Decrypt ``blobs`` under this key and encrypt each under ``target`` with a fresh random
        nonce, decrypting every result again to prove it reads back as the same plaintext: (new
        values, positions that did not decrypt). None stays None; a position that did not decrypt
        gets None too. Raises VerificationFailed if a new value does not read back. The loop is the
        drain's hot path: the per-value work is the three AEAD calls."""
        nonces = os.urandom(NONCE_LEN * len(blobs))
        decrypt = self._aead.decrypt
        encrypt = target._aead.encrypt
        check = target._aead.decrypt
        out: list[bytes | None] = []
        bad: list[int] = []
        for i, blob in enumerate(blobs):
            if blob is None:
                out.append(None)
                continue
            if len(blob) < NONCE_LEN + TAG_LEN:
                bad.append(i)
                out.append(None)
                continue
            try:
                plaintext = decrypt(blob[:NONCE_LEN], blob[NONCE_LEN:], None)
            except InvalidTag:
                bad.append(i)
                out.append(None)
                continue
            nonce = nonces[i * NONCE_LEN:(i + 1) * NONCE_LEN]
            body = encrypt(nonce, plaintext, None)
            try:
                if check(nonce, body, None) != plaintext:
                    raise VerificationFailed("re-encrypted value does not read back")
            except InvalidTag:
                raise VerificationFailed("re-encrypted value does not authenticate") from None
            out.append(nonce + body)
        return out, bad

    def __repr__(self) -> str:
        return "AesGcm(<redacted>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("key objects cannot be pickled")


class Sm4Gcm:
    """nonce(12) || ciphertext || tag(16), SM4 in GCM mode (cryptography's Cipher API)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) != 16:
            raise ValueError("SM4 key must be 16 bytes")
        self._key = key

    def encrypt(self, plaintext: bytes, nonce: bytes | None = None) -> bytes:
        nonce = random_nonce() if nonce is None else nonce
        enc = Cipher(algorithms.SM4(self._key), modes.GCM(nonce)).encryptor()
        body = enc.update(plaintext) + enc.finalize()
        return nonce + body + enc.tag

    def decrypt(self, blob: bytes) -> bytes:
        if len(blob) < NONCE_LEN + TAG_LEN:
            raise CiphertextInvalid("ciphertext too short")
        nonce, body, tag = blob[:NONCE_LEN], blob[NONCE_LEN:-TAG_LEN], blob[-TAG_LEN:]
        try:
            dec = Cipher(algorithms.SM4(self._key), modes.GCM(nonce, tag)).decryptor()
            return dec.update(body) + dec.finalize()
        except InvalidTag:
            raise CiphertextInvalid("ciphertext does not authenticate") from None

    def __repr__(self) -> str:
        return "Sm4Gcm(<redacted>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("key objects cannot be pickled")


class AesEcbPkcs7:
    """Legacy, read-only: AES-ECB with PKCS#7 padding, as many older Java services wrote."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) not in (16, 24, 32):
            raise ValueError("AES key must be 16, 24 or 32 bytes")
        self._key = key

    def encrypt(self, plaintext: bytes) -> bytes:
        # Only tests and fixtures write this legacy form; pinrotate never does.
        padder = padding.PKCS7(128).padder()
        enc = Cipher(algorithms.AES(self._key), modes.ECB()).encryptor()
        return enc.update(padder.update(plaintext) + padder.finalize()) + enc.finalize()

    def decrypt(self, blob: bytes) -> bytes:
        if not blob or len(blob) % 16:
            raise CiphertextInvalid("ciphertext is not a whole number of blocks")
        dec = Cipher(algorithms.AES(self._key), modes.ECB()).decryptor()
        padded = dec.update(blob) + dec.finalize()
        unpadder = padding.PKCS7(128).unpadder()
        try:
            return unpadder.update(padded) + unpadder.finalize()
        except ValueError:
            raise CiphertextInvalid("ciphertext padding is invalid") from None

    def __repr__(self) -> str:
        return "AesEcbPkcs7(<redacted>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("key objects cannot be pickled")


# The fixed, versioned input of every key check value: a new label means a new algorithm name.
KEY_CHECK_LABEL = b"pinrotate key check value v1"
KEY_CHECK_BYTES = 16


def key_check_value(material: bytes) -> str:
    """HMAC-SHA256 keyed with the key over ``KEY_CHECK_LABEL``, first 128 bits, hex.

    A PRF output on a fixed public input: it tells two keys apart and says nothing about either
    (finding a key from it is a brute force of the whole key space). Never an input of a cipher.
    """
    mac = hmac.HMAC(material, hashes.SHA256())
    mac.update(KEY_CHECK_LABEL)
    return mac.finalize()[:KEY_CHECK_BYTES].hex()
