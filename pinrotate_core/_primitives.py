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


class EcbPkcs7:
    """SM4 or AES in ECB mode with PKCS#7 padding: what Forge's encryptors (hutool's
    ``SmUtil.sm4(key)`` and ``SecureUtil.aes(key)``) write. No integrity of its own: a wrong key is
    caught only by the padding check (which random bytes pass about once in 256 tries) and by what
    the caller checks of the plaintext. One object per (algorithm, key)."""

    __slots__ = ("_algorithm", "_key")

    def __init__(self, algorithm: str, key: bytes) -> None:
        if algorithm == "SM4":
            if len(key) != 16:
                raise ValueError("SM4 key must be 16 bytes")
        elif algorithm == "AES":
            if len(key) not in (16, 24, 32):
                raise ValueError("AES key must be 16, 24 or 32 bytes")
        else:
            raise ValueError("algorithm must be SM4 or AES")
        self._algorithm = algorithm
        self._key = key

    def _cipher(self) -> Cipher[modes.ECB]:
        block = algorithms.SM4(self._key) if self._algorithm == "SM4" else algorithms.AES(self._key)
        return Cipher(block, modes.ECB())

    def encrypt(self, plaintext: bytes) -> bytes:
        padder = padding.PKCS7(128).padder()
        enc = self._cipher().encryptor()
        return enc.update(padder.update(plaintext) + padder.finalize()) + enc.finalize()

    def decrypt(self, blob: bytes) -> bytes:
        """The plaintext, or CiphertextInvalid: ``PaddingInvalid`` when the blocks decrypt but their
        padding is wrong (what a wrong key gives), plain CiphertextInvalid for a misshapen blob."""
        if not blob or len(blob) % 16:
            raise CiphertextInvalid("ciphertext is not a whole number of blocks")
        dec = self._cipher().decryptor()
        padded = dec.update(blob) + dec.finalize()
        unpadder = padding.PKCS7(128).unpadder()
        try:
            return unpadder.update(padded) + unpadder.finalize()
        except ValueError:
            raise PaddingInvalid("ciphertext padding is invalid") from None

    def __repr__(self) -> str:
        return f"EcbPkcs7({self._algorithm}, <redacted>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("key objects cannot be pickled")


class PaddingInvalid(CiphertextInvalid):
    """An ECB value whose blocks decrypted but whose padding (or, for text, UTF-8) is wrong: the sign
    of a wrong key, which no tag catches (the fpc1 scheme holds back every value of that key)."""


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
