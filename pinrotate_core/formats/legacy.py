"""Read-only legacy (unversioned) ciphertexts of ``fpc1`` targets (contract §2).

Two forms, both standard base64 text under the single legacy key: ``aesgcm-b64`` (nonce(12) ||
ciphertext || tag(16), AES-GCM sized by the key) and ``aes-ecb-b64`` (AES-ECB/PKCS#7). This
module only ever decrypts: nothing new is written in a legacy form.
"""

from __future__ import annotations

import base64
import binascii
from typing import Final, Literal, NoReturn

from .._primitives import NONCE_LEN, TAG_LEN, AesEcbPkcs7, AesGcm
from ..errors import CiphertextInvalid, ConfigError
from ..keyring import Key

LegacyFormat = Literal["aesgcm-b64", "aes-ecb-b64"]
LEGACY_FORMATS: Final[tuple[LegacyFormat, ...]] = ("aesgcm-b64", "aes-ecb-b64")
DEFAULT_LEGACY_FORMAT: Final[LegacyFormat] = "aesgcm-b64"

_AES_BLOCK = 16


def check_legacy_format(legacy_format: str) -> LegacyFormat:
    """``legacy_format`` if it is one we read, else a ConfigError naming the setting."""
    for known in LEGACY_FORMATS:
        if legacy_format == known:
            return known
    raise ConfigError("keys.legacy_format: must be \"aesgcm-b64\" or \"aes-ecb-b64\"")


def decode_base64_strict(text: str) -> bytes:
    """Standard base64 with padding, nothing else (no whitespace, no URL-safe alphabet)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        # ValueError covers non-ASCII text. The message must not echo the value.
        raise CiphertextInvalid("value is not valid base64") from None


def legacy_blob_plausible(blob: bytes, legacy_format: LegacyFormat) -> bool:
    """Could these decoded bytes be a legacy ciphertext of this form? (shape only, no key)."""
    if legacy_format == "aesgcm-b64":
        return len(blob) >= NONCE_LEN + TAG_LEN
    return len(blob) >= _AES_BLOCK and len(blob) % _AES_BLOCK == 0


def looks_like_legacy(stored: str, legacy_format: LegacyFormat = DEFAULT_LEGACY_FORMAT) -> bool:
    """Cheap shape test used by inventory: strict base64 of a plausible ciphertext length."""
    try:
        blob = decode_base64_strict(stored)
    except CiphertextInvalid:
        return False
    return legacy_blob_plausible(blob, legacy_format)


class LegacyCipher:
    """Decrypt-only reader of one legacy form under the legacy key; built once per run."""

    __slots__ = ("_cipher", "legacy_format")

    def __init__(self, key: Key, legacy_format: str = DEFAULT_LEGACY_FORMAT) -> None:
        self.legacy_format: LegacyFormat = check_legacy_format(legacy_format)
        # Key already guarantees 16, 24 or 32 bytes, which both primitives accept.
        self._cipher: AesGcm | AesEcbPkcs7 = (
            AesGcm(key.material) if self.legacy_format == "aesgcm-b64" else AesEcbPkcs7(key.material)
        )

    def decrypt(self, stored: str) -> bytes:
        """Plaintext of a legacy value, or CiphertextInvalid (never a message with the value).

        ``aes-ecb-b64`` is not authenticated: a wrong legacy key is caught only by the PKCS#7
        padding check, which a random block passes roughly once in 256 tries.
        """
        return self.decrypt_blob(decode_base64_strict(stored))

    def decrypt_blob(self, blob: bytes) -> bytes:
        """As ``decrypt``, for a value whose base64 the caller has already decoded."""
        if not legacy_blob_plausible(blob, self.legacy_format):
            raise CiphertextInvalid(f"value is too short or misaligned for legacy {self.legacy_format}")
        return self._cipher.decrypt(blob)

    def __repr__(self) -> str:
        return f"LegacyCipher({self.legacy_format}, <redacted>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("cipher objects cannot be pickled: key material never leaves the process")
