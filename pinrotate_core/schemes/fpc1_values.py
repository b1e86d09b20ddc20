"""``fpc1`` values alone: ``FPC1:<algorithm>:<keyId>:<base64(nonce||ct||tag)>``, the read-only
legacy forms (``aesgcm-b64``, ``aes-ecb-b64``), classification, and the cipher set that decrypts
and writes them. No SQL here: the scheme (``fpc1.py``) composes these into statements. No error
message here contains a value, a plaintext or a key.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, NoReturn

from cryptography.exceptions import UnsupportedAlgorithm

from .._primitives import NONCE_LEN, TAG_LEN, AesEcbPkcs7, AesGcm, Sm4Gcm
from ..errors import CiphertextInvalid, ConfigError, KeyUnavailable, VerificationFailed
from ..keyring import KEY_ID_PATTERN, Key, Keyring
from ._json_paths import json_values_in
from .base import (
    LEGACY_KEY,
    UNKNOWN_VALUE,
    ValueClass,
)

# --- legacy forms -------------------------------------------------------------------------------

LegacyFormat = Literal["aesgcm-b64", "aes-ecb-b64"]
LEGACY_FORMATS: Final[tuple[LegacyFormat, ...]] = ("aesgcm-b64", "aes-ecb-b64")
DEFAULT_LEGACY_FORMAT: Final[LegacyFormat] = "aesgcm-b64"
# What an aes-ecb-b64 plaintext must be to count as decrypted: ECB has no tag, so a value written
# under another key passes the PKCS#7 padding check about once in 256 tries; "utf8" also requires
# valid UTF-8 (the only other integrity such a value has), "bytes" accepts any plaintext.
LegacyPlaintext = Literal["utf8", "bytes"]

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

    __slots__ = ("_cipher", "legacy_format", "legacy_plaintext")

    def __init__(self, key: Key, legacy_format: str = DEFAULT_LEGACY_FORMAT,
                 legacy_plaintext: LegacyPlaintext = "utf8") -> None:
        self.legacy_format: LegacyFormat = check_legacy_format(legacy_format)
        self.legacy_plaintext = legacy_plaintext
        # Key already guarantees 16, 24 or 32 bytes, which both primitives accept.
        self._cipher: AesGcm | AesEcbPkcs7 = (
            AesGcm(key.material) if self.legacy_format == "aesgcm-b64" else AesEcbPkcs7(key.material)
        )

    def decrypt(self, stored: str) -> bytes:
        """Plaintext of a legacy value, or CiphertextInvalid (never a message with the value).

        ``aes-ecb-b64`` is not authenticated: a wrong key is caught by the PKCS#7 padding check,
        which a random block passes roughly once in 256 tries, and (``legacy_plaintext = "utf8"``)
        by the plaintext having to be valid UTF-8.
        """
        return self.decrypt_blob(decode_base64_strict(stored))

    def decrypt_blob(self, blob: bytes) -> bytes:
        """As ``decrypt``, for a value whose base64 the caller has already decoded."""
        if not legacy_blob_plausible(blob, self.legacy_format):
            raise CiphertextInvalid(f"value is too short or misaligned for legacy {self.legacy_format}")
        plaintext = self._cipher.decrypt(blob)
        if self.legacy_format == "aes-ecb-b64" and self.legacy_plaintext == "utf8":
            try:
                plaintext.decode("utf-8")
            except UnicodeDecodeError:
                raise CiphertextInvalid("legacy aes-ecb-b64 value does not decrypt to UTF-8 text") from None
        return plaintext

    def __repr__(self) -> str:
        return f"LegacyCipher({self.legacy_format}, <redacted>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("cipher objects cannot be pickled: key material never leaves the process")


# --- the FPC1 format ----------------------------------------------------------------------------

Algorithm = Literal["AES-GCM", "SM4-GCM"]
ALGORITHMS: Final[tuple[Algorithm, ...]] = ("AES-GCM", "SM4-GCM")
PREFIX: Final = "FPC1"
FPC1_KEY_LENGTH: Final = 16
MIN_PAYLOAD_LEN: Final = NONCE_LEN + TAG_LEN

ValueKind = Literal["fpc1", "legacy-candidate", "unknown"]


def check_algorithm(algorithm: str) -> Algorithm:
    for known in ALGORITHMS:
        if algorithm == known:
            return known
    raise ConfigError("fpc1 algorithm: must be \"AES-GCM\" or \"SM4-GCM\"")


@dataclass(frozen=True)
class Fpc1Value:
    """One parsed FPC1 value. ``payload`` is nonce(12) || ciphertext || tag(16), kept out of repr."""

    algorithm: Algorithm
    key_id: str
    payload: bytes = field(repr=False)

    def to_stored(self) -> str:
        """The stored string again (explicit, so an f-string or a log line never renders it)."""
        return format_fpc1(self.algorithm, self.key_id, self.payload)

    def __repr__(self) -> str:
        return f"Fpc1Value(algorithm={self.algorithm!r}, key_id={self.key_id!r}, payload=<{len(self.payload)} bytes>)"

    __str__ = __repr__


def format_fpc1(algorithm: Algorithm, key_id: str, payload: bytes) -> str:
    return f"{PREFIX}:{algorithm}:{key_id}:{base64.b64encode(payload).decode('ascii')}"


def parse_fpc1(stored: str) -> Fpc1Value:
    """Split and check an FPC1 value; CiphertextInvalid (naming what is wrong, never the value)."""
    parts = stored.split(":", 3)
    if len(parts) != 4 or parts[0] != PREFIX:
        raise CiphertextInvalid("value is not an FPC1 value (expected FPC1:<algorithm>:<keyId>:<payload>)")
    _, algorithm, key_id, encoded = parts
    if algorithm not in ALGORITHMS:
        raise CiphertextInvalid("FPC1 value names an unknown algorithm")
    if not KEY_ID_PATTERN.fullmatch(key_id):
        raise CiphertextInvalid("FPC1 value has a malformed key id")
    try:
        payload = decode_base64_strict(encoded)
    except CiphertextInvalid:
        raise CiphertextInvalid("FPC1 payload is not valid base64") from None
    if len(payload) < MIN_PAYLOAD_LEN:
        raise CiphertextInvalid("FPC1 payload is shorter than nonce and tag")
    return Fpc1Value(check_algorithm(algorithm), key_id, payload)


@dataclass(frozen=True)
class Classification:
    """What a stored string looks like, without any key: the inventory's first question."""

    kind: ValueKind
    key_id: str | None = None
    algorithm: Algorithm | None = None


_UNKNOWN: Final = Classification("unknown")
_LEGACY: Final = Classification("legacy-candidate")


def classify(stored: str, *, legacy_format: LegacyFormat = DEFAULT_LEGACY_FORMAT) -> Classification:
    """``fpc1`` (with key id and algorithm), ``legacy-candidate`` or ``unknown``; never raises.

    Anything starting ``FPC1:`` is FPC1 or unknown, never legacy: base64 has no ``:``.
    """
    if stored.startswith(PREFIX + ":"):
        try:
            value = parse_fpc1(stored)
        except CiphertextInvalid:
            return _UNKNOWN
        return Classification("fpc1", value.key_id, value.algorithm)
    try:
        blob = decode_base64_strict(stored)
    except CiphertextInvalid:
        return _UNKNOWN
    return _LEGACY if legacy_blob_plausible(blob, legacy_format) else _UNKNOWN


class Fpc1CipherSet:
    """The ciphers of one run for an ``fpc1`` target: one object per (algorithm, key id).

    Validates the keyring at construction (16-byte keys, well-formed ids) so a bad key stops the
    start, not row 80,000. A key id missing from the keyring is KeyUnavailable (the caller counts
    it as UNKNOWN_KEY); a value that does not decrypt is CiphertextInvalid.
    """

    def __init__(
        self,
        keyring: Keyring,
        *,
        algorithm: str = "AES-GCM",
        legacy_format: str = DEFAULT_LEGACY_FORMAT,
        legacy_read_enabled: bool = False,
        legacy_plaintext: LegacyPlaintext = "utf8",
    ) -> None:
        if keyring.server_side:
            raise ConfigError(f"{keyring.source}: fpc1 targets need local key material, not a server-side keyring")
        self.keyring = keyring
        self.algorithm: Algorithm = check_algorithm(algorithm)
        self.legacy_format: LegacyFormat = check_legacy_format(legacy_format)
        self.legacy_read_enabled = legacy_read_enabled
        self.legacy_plaintext = legacy_plaintext
        for key_id, key in keyring.keys.items():
            if not KEY_ID_PATTERN.fullmatch(key_id):
                raise ConfigError(f"{keyring.source}: key id {key_id!r} must match [A-Za-z0-9_-]{{1,32}}")
            if len(key.material) != FPC1_KEY_LENGTH:
                raise ConfigError(
                    f"{keyring.source}: key {key_id}: fpc1 keys must be 16 bytes (AES-128 / SM4), "
                    f"got {len(key.material)}"
                )
        self._ciphers: dict[tuple[Algorithm, str], AesGcm | Sm4Gcm] = {}
        self._legacy: LegacyCipher | None = None
        # Build the writing cipher now: a missing SM4 in this OpenSSL fails the start, not a batch.
        self.cipher(self.algorithm, keyring.current)

    @property
    def current_key_id(self) -> str:
        return self.keyring.current

    @property
    def can_read_legacy(self) -> bool:
        """Legacy reading is on and the keyring has a legacy key (else legacy values are KeyUnavailable)."""
        return self.legacy_read_enabled and self.keyring.legacy is not None

    def cipher(self, algorithm: Algorithm, key_id: str) -> AesGcm | Sm4Gcm:
        cached = self._ciphers.get((algorithm, key_id))
        if cached is not None:
            return cached
        # KeyUnavailable propagates: a missing key is a provider failure, not a bad value.
        material = self.keyring.key(key_id).material
        cipher: AesGcm | Sm4Gcm
        if algorithm == "AES-GCM":
            cipher = AesGcm(material)
        else:
            cipher = Sm4Gcm(material)
            try:
                cipher.encrypt(b"")
            except UnsupportedAlgorithm:
                raise ConfigError("fpc1 algorithm: this OpenSSL build has no SM4-GCM") from None
        self._ciphers[(algorithm, key_id)] = cipher
        return cipher

    def legacy_cipher(self) -> LegacyCipher:
        if not self.legacy_read_enabled:
            raise KeyUnavailable("legacy value: reading legacy ciphertext is off (keys.legacy_read_enabled = false)")
        if self._legacy is None:
            if self.keyring.legacy is None:
                raise KeyUnavailable(f"legacy value: the keyring has no legacy key ({self.keyring.source})")
            self._legacy = LegacyCipher(self.keyring.legacy, self.legacy_format, self.legacy_plaintext)
        return self._legacy

    def classify(self, stored: str) -> Classification:
        return classify(stored, legacy_format=self.legacy_format)

    def decrypt(self, stored: str) -> bytes:
        """Plaintext of an FPC1 or legacy value.

        KeyUnavailable: the FPC1 key id is not in the keyring, or a legacy value meets legacy
        reading switched off or no legacy key. CiphertextInvalid: anything else that fails.
        """
        if stored.startswith(PREFIX + ":"):
            return self.decrypt_fpc1(parse_fpc1(stored))
        try:
            blob = decode_base64_strict(stored)
        except CiphertextInvalid:
            raise CiphertextInvalid("value is neither FPC1 nor a legacy ciphertext") from None
        if not legacy_blob_plausible(blob, self.legacy_format):
            raise CiphertextInvalid("value is neither FPC1 nor a legacy ciphertext")
        return self.legacy_cipher().decrypt_blob(blob)

    def decrypt_fpc1(self, value: Fpc1Value) -> bytes:
        return self.cipher(value.algorithm, value.key_id).decrypt(value.payload)

    def encrypt_current(self, plaintext: bytes, nonce: bytes | None = None) -> str:
        """A new FPC1 value under the current key; ``nonce`` is for known-answer tests only."""
        if nonce is not None and len(nonce) != NONCE_LEN:
            raise ValueError("nonce must be 12 bytes")
        payload = self.cipher(self.algorithm, self.keyring.current).encrypt(plaintext, nonce)
        return format_fpc1(self.algorithm, self.keyring.current, payload)

    def reencrypt_to_current(self, stored: str, nonce: bytes | None = None) -> str:
        """``stored`` (FPC1 on any key, or legacy) as a new FPC1 value under the current key.

        The new value is decrypted again and compared before it is returned (contract §5):
        VerificationFailed if it does not read back. Errors as for ``decrypt``.
        """
        plaintext = self.decrypt(stored)
        rewritten = self.encrypt_current(plaintext, nonce)
        try:
            readback = self.decrypt_fpc1(parse_fpc1(rewritten))
        except CiphertextInvalid:
            raise VerificationFailed("re-encrypted value does not authenticate") from None
        if readback != plaintext:
            raise VerificationFailed("re-encrypted value does not read back")
        return rewritten

    def __repr__(self) -> str:
        return (
            f"Fpc1CipherSet(algorithm={self.algorithm!r}, current={self.keyring.current!r}, "
            f"legacy_read_enabled={self.legacy_read_enabled!r})"
        )

    def __reduce__(self) -> NoReturn:
        raise TypeError("cipher sets cannot be pickled: key material never leaves the process")


# --- values of a target -------------------------------------------------------------------------

# "FPC1:" + algorithm + ":" ... ":" around the key id; both algorithm names have the same length.
assert len({len(a) for a in ALGORITHMS}) == 1
FPC1_OVERHEAD: Final = len(PREFIX) + 1 + len(ALGORITHMS[0]) + 1 + 1
NONCE_AND_TAG: Final = NONCE_LEN + TAG_LEN
# The most a value can grow on migration, beyond the new prefix: an aes-ecb-b64 legacy value
# (payload up to 27 bytes longer, i.e. 36 more base64 characters). Used to pre-filter in SQL.
MAX_PAYLOAD_GROWTH: Final = 36
JSON_REWRITE_REFUSED: Final = "json_rewrite_refused"


@dataclass(frozen=True)
class ValueField:
    """Where one encrypted value lives: a column, or a JSON path inside a column."""

    column: str
    path: str | None = None

    @property
    def label(self) -> str:
        return self.column if self.path is None else f"{self.column}[{self.path}]"


def classify_value(stored: str, keyring: Keyring, legacy_format: LegacyFormat) -> ValueClass:
    """The inventory category of a stored string, without decrypting it."""
    found = classify(stored, legacy_format=legacy_format)
    if found.kind == "fpc1":
        assert found.key_id is not None
        if found.key_id == keyring.current:
            return ValueClass("ACTIVE", found.key_id)
        if found.key_id in keyring.keys:
            return ValueClass("HISTORICAL", found.key_id)
        return ValueClass("UNKNOWN_KEY", found.key_id)
    if found.kind == "legacy-candidate":
        return ValueClass("LEGACY", LEGACY_KEY)
    return UNKNOWN_VALUE


def values_of_column(column: str, paths: Sequence[str], text: str | None) -> list[tuple[ValueField, str | None]]:
    """The encrypted values of one column of one row; ``None`` marks a value that cannot be read.

    A plain column is one value (NULL: none). A ``json_paths`` column holds one value per path
    (absent or null paths: none); a document that is not JSON is one unreadable value, a path
    holding a non-string is an unreadable value at that path.
    """
    if text is None:
        return []
    if not paths:
        return [(ValueField(column), text)]
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return [(ValueField(column), None)]
    out: list[tuple[ValueField, str | None]] = []
    for path in paths:
        try:
            found = json_values_in(document, [path])
        except CiphertextInvalid:
            out.append((ValueField(column, path), None))
            continue
        if path in found:
            out.append((ValueField(column, path), found[path]))
    return out


def length_after(stored: str, value: ValueClass, active_key: str, legacy_format: LegacyFormat) -> int | None:
    """Characters the value will have once migrated to ``active_key``; None if it is never rewritten.

    Known from the stored form alone: GCM keeps the payload length (plaintext + 28 bytes); an
    aes-ecb-b64 value holds a padded plaintext of at most payload - 1 bytes (bound taken).
    """
    if value.category == "ACTIVE":
        return len(stored)
    prefix = FPC1_OVERHEAD + len(active_key)
    if value.category in ("HISTORICAL", "UNKNOWN_KEY"):
        return prefix + len(stored.split(":", 3)[3])
    if value.category == "LEGACY":
        if legacy_format == "aesgcm-b64":
            return prefix + len(stored)
        padded = len(decode_base64_strict(stored))
        return prefix + 4 * math.ceil((padded - 1 + NONCE_AND_TAG) / 3)
    return None


# --- the scheme ---------------------------------------------------------------------------------
