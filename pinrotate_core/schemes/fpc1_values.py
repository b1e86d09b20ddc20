"""``fpc1`` values alone, exactly as Forge's ``PersistentCryptoService`` writes and reads them:
``FPC1:<SM4|AES>:<keyId>:<payload>``, the payload standard base64 (hex is read too) of SM4 or AES
in ECB mode with PKCS#7 padding over the UTF-8 plaintext; legacy values are the bare payload under
the legacy key, with their column's algorithm. Classification, and the cipher set that decrypts and
writes them. No SQL here: the scheme (``fpc1.py``) composes these into statements. No error
message here contains a value, a plaintext or a key.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, NoReturn

from .._primitives import EcbPkcs7, PaddingInvalid
from ..errors import CiphertextInvalid, ConfigError, KeyUnavailable, VerificationFailed
from ..keyring import KEY_ID_PATTERN, Key, Keyring
from ._json_paths import json_values_in
from .base import LEGACY_KEY, UNKNOWN_VALUE, ValueClass

# --- algorithms and payloads ---------------------------------------------------------------------

Algorithm = Literal["SM4", "AES"]
ALGORITHMS: Final[tuple[Algorithm, ...]] = ("SM4", "AES")
DEFAULT_ALGORITHM: Final[Algorithm] = "SM4"  # Forge's forge.crypto.algorithm default
PREFIX: Final = "FPC1"
FPC1_KEY_LENGTH: Final = 16
BLOCK: Final = 16
_HEX = re.compile(r"[0-9A-Fa-f]+")


def algorithm_of(code: str) -> Algorithm | None:
    """Forge's ``CryptoAlgorithm.fromCode`` on a stored header: ``SM4``/``AES`` in any case, else None."""
    upper = code.upper()
    for known in ALGORITHMS:
        if upper == known:
            return known
    return None


def check_algorithm(code: object, setting: str) -> Algorithm:
    """``code`` as an algorithm, or a ConfigError naming ``setting`` (never the value)."""
    found = algorithm_of(code) if isinstance(code, str) else None
    if found is None:
        raise ConfigError(f"{setting}: must be \"SM4\" or \"AES\"")
    return found


def decode_payload(text: str) -> bytes:
    """hutool's ``decryptStr`` input: hex when every character is a hex digit, else standard base64
    (with padding, nothing else); the bytes must be whole cipher blocks. CiphertextInvalid otherwise."""
    try:
        blob = bytes.fromhex(text) if _HEX.fullmatch(text) else base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        # ValueError covers odd hex and non-ASCII text. The message must not echo the value.
        raise CiphertextInvalid("payload is neither hex nor standard base64") from None
    if not blob or len(blob) % BLOCK:
        raise CiphertextInvalid("payload is not a whole number of cipher blocks")
    return blob


def encode_payload(blob: bytes) -> str:
    """hutool's ``encryptBase64``: standard base64 with padding."""
    return base64.b64encode(blob).decode("ascii")


def is_blank(text: str) -> bool:
    """Forge's ``StrUtil.isBlank``: empty or whitespace only. Such a value is no ciphertext."""
    return not text or text.isspace()


# --- the FPC1 format ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fpc1Value:
    """One parsed FPC1 value; ``payload`` is its text as stored (base64 or hex), kept out of repr."""

    algorithm: Algorithm
    key_id: str
    payload: str = field(repr=False)

    def __repr__(self) -> str:
        return f"Fpc1Value(algorithm={self.algorithm!r}, key_id={self.key_id!r}, payload=<{len(self.payload)} chars>)"

    __str__ = __repr__


def format_fpc1(algorithm: Algorithm, key_id: str, blob: bytes) -> str:
    """What Forge writes with ``write-versioned = true``: the upper-case code and base64."""
    return f"{PREFIX}:{algorithm}:{key_id}:{encode_payload(blob)}"


def parse_fpc1(stored: str) -> Fpc1Value:
    """Forge's header rules (``PersistentCiphertext.inspect``): ``split(":", 4)`` into four parts, a
    known algorithm, a legal key id, a non-blank payload. CiphertextInvalid (never the value) when
    Forge calls the value UNKNOWN. The payload is decoded only when the value is decrypted."""
    parts = stored.split(":", 3)
    if len(parts) != 4 or parts[0] != PREFIX:
        raise CiphertextInvalid("value is not an FPC1 value (expected FPC1:<algorithm>:<keyId>:<payload>)")
    _, code, key_id, payload = parts
    algorithm = algorithm_of(code)
    if algorithm is None:
        raise CiphertextInvalid("FPC1 value names an algorithm other than SM4 and AES")
    if not KEY_ID_PATTERN.fullmatch(key_id):
        raise CiphertextInvalid("FPC1 value has an illegal key id")
    if is_blank(payload):
        raise CiphertextInvalid("FPC1 value has an empty payload")
    return Fpc1Value(algorithm, key_id, payload)


ValueKind = Literal["fpc1", "legacy-candidate", "unknown"]


@dataclass(frozen=True)
class Classification:
    """What a stored string looks like, without any key: the inventory's first question."""

    kind: ValueKind
    key_id: str | None = None
    algorithm: Algorithm | None = None


_UNKNOWN: Final = Classification("unknown")
_LEGACY: Final = Classification("legacy-candidate")


def classify(stored: str) -> Classification:
    """``fpc1`` (with key id and algorithm), ``legacy-candidate`` or ``unknown``; never raises.

    As Forge: anything starting ``FPC1:`` is FPC1 or UNKNOWN, never legacy. Text without the header
    is a legacy value when its payload could be one (hex or base64 of whole blocks); any other text
    (e.g. a plaintext an older Forge left behind) is UNKNOWN: no key can read it, a person must.
    """
    if stored.startswith(PREFIX + ":"):
        try:
            value = parse_fpc1(stored)
        except CiphertextInvalid:
            return _UNKNOWN
        return Classification("fpc1", value.key_id, value.algorithm)
    try:
        decode_payload(stored)
    except CiphertextInvalid:
        return _UNKNOWN
    return _LEGACY


def group_of(stored: str) -> str | None:
    """The key a value is read with: its key id, ``legacy``, or None (UNKNOWN). The unit of the
    all-or-nothing rule: no value of a key is rewritten while one of them fails its checks."""
    found = classify(stored)
    if found.kind == "fpc1":
        return found.key_id
    return LEGACY_KEY if found.kind == "legacy-candidate" else None


def decrypt_text(cipher: EcbPkcs7, blob: bytes) -> bytes:
    """The UTF-8 plaintext of ``blob``: PaddingInvalid when the padding or the UTF-8 fails (the only
    checks an ECB value has)."""
    plaintext = cipher.decrypt(blob)
    try:
        plaintext.decode("utf-8")
    except UnicodeDecodeError:
        raise PaddingInvalid("value does not decrypt to UTF-8 text") from None
    return plaintext


class Fpc1CipherSet:
    """The ciphers of one run for ``fpc1`` targets: one object per (algorithm, key id).

    Validates the keyring at construction (16-byte keys, legal ids) so that a bad key stops the
    start, not row 80,000. A key id missing from the keyring is KeyUnavailable (the caller counts
    it as UNKNOWN_KEY); a value that does not decrypt is CiphertextInvalid, ``PaddingInvalid`` when
    its padding or UTF-8 fails (the sign of a wrong key).
    """

    def __init__(self, keyring: Keyring, *, legacy_read_enabled: bool = False) -> None:
        if keyring.server_side:
            raise ConfigError(f"{keyring.source}: fpc1 targets need local key material, not a server-side keyring")
        self.keyring = keyring
        self.legacy_read_enabled = legacy_read_enabled
        for key_id, key in keyring.keys.items():
            if not KEY_ID_PATTERN.fullmatch(key_id):
                raise ConfigError(f"{keyring.source}: key id {key_id!r} must match [A-Za-z0-9_-]{{1,32}}")
            if len(key.material) != FPC1_KEY_LENGTH:
                raise ConfigError(
                    f"{keyring.source}: key {key_id}: fpc1 keys must be 16 bytes (SM4 / AES-128), "
                    f"got {len(key.material)}"
                )
        self._ciphers: dict[tuple[Algorithm, str], EcbPkcs7] = {}

    @property
    def current_key_id(self) -> str:
        return self.keyring.current

    @property
    def can_read_legacy(self) -> bool:
        """Legacy reading is on and the keyring has a legacy key (else legacy values are KeyUnavailable)."""
        return self.legacy_read_enabled and self.keyring.legacy is not None

    def _build(self, algorithm: Algorithm, key_id: str, key: Key) -> EcbPkcs7:
        cached = self._ciphers.get((algorithm, key_id))
        if cached is None:
            try:
                cached = self._ciphers[(algorithm, key_id)] = EcbPkcs7(algorithm, key.material)
            except ValueError:
                raise KeyUnavailable(f"key {key_id}: {len(key.material)} bytes cannot be an {algorithm} key"
                                     " (SM4 takes 16, AES 16, 24 or 32)") from None
        return cached

    def cipher(self, algorithm: Algorithm, key_id: str) -> EcbPkcs7:
        # KeyUnavailable propagates: a missing key is a provider failure, not a bad value.
        return self._build(algorithm, key_id, self.keyring.key(key_id))

    def legacy_cipher(self, algorithm: Algorithm) -> EcbPkcs7:
        if not self.legacy_read_enabled:
            raise KeyUnavailable("legacy value: reading legacy ciphertext is off (keys.legacy_read_enabled = false)")
        if self.keyring.legacy is None:
            raise KeyUnavailable(f"legacy value: the keyring has no legacy key ({self.keyring.source})")
        return self._build(algorithm, LEGACY_KEY, self.keyring.legacy)

    def decrypt(self, stored: str, legacy_algorithm: Algorithm = DEFAULT_ALGORITHM) -> bytes:
        """UTF-8 plaintext of an FPC1 value, or of a legacy value read with ``legacy_algorithm``.

        KeyUnavailable: the FPC1 key id is not in the keyring, or a legacy value meets legacy
        reading switched off or no legacy key. CiphertextInvalid: anything else that fails.
        """
        if stored.startswith(PREFIX + ":"):
            value = parse_fpc1(stored)
            return decrypt_text(self.cipher(value.algorithm, value.key_id), decode_payload(value.payload))
        blob = decode_payload(stored)
        return decrypt_text(self.legacy_cipher(legacy_algorithm), blob)

    def encrypt_current(self, algorithm: Algorithm, plaintext: bytes) -> str:
        """A new FPC1 value of ``algorithm`` under the current key (deterministic: ECB)."""
        return format_fpc1(algorithm, self.keyring.current, self.cipher(algorithm, self.keyring.current).encrypt(plaintext))

    def reencrypt_to_current(self, stored: str, legacy_algorithm: Algorithm = DEFAULT_ALGORITHM) -> str:
        """``stored`` (FPC1 on any key, or legacy) as Forge's ``reencrypt`` writes it: FPC1 under the
        current key with the value's own algorithm (a legacy value's: ``legacy_algorithm``).

        The new value is decrypted again and compared before it is returned (contract §5):
        VerificationFailed if it does not read back. Errors as for ``decrypt``.
        """
        algorithm = parse_fpc1(stored).algorithm if stored.startswith(PREFIX + ":") else legacy_algorithm
        plaintext = self.decrypt(stored, legacy_algorithm)
        rewritten = self.encrypt_current(algorithm, plaintext)
        try:
            readback = self.decrypt(rewritten)
        except CiphertextInvalid:
            raise VerificationFailed("re-encrypted value does not read back") from None
        if readback != plaintext:
            raise VerificationFailed("re-encrypted value does not read back")
        return rewritten

    def __repr__(self) -> str:
        return f"Fpc1CipherSet(current={self.keyring.current!r}, legacy_read_enabled={self.legacy_read_enabled!r})"

    def __reduce__(self) -> NoReturn:
        raise TypeError("cipher sets cannot be pickled: key material never leaves the process")


# --- values of a target -------------------------------------------------------------------------

# "FPC1:" + algorithm + ":" ... ":" around the key id; both algorithm codes have the same length.
assert len({len(a) for a in ALGORITHMS}) == 1
FPC1_OVERHEAD: Final = len(PREFIX) + 1 + len(ALGORITHMS[0]) + 1 + 1
# The most a value's payload can grow on migration: a hex payload (2 characters a byte) becomes
# base64 (4 per 3) and never longer; base64 stays the same length (same plaintext, same padding).
MAX_PAYLOAD_GROWTH: Final = 0
JSON_REWRITE_REFUSED: Final = "json_rewrite_refused"


@dataclass(frozen=True)
class ValueField:
    """Where one encrypted value lives: a column, or a JSON path inside a column."""

    column: str
    path: str | None = None

    @property
    def label(self) -> str:
        return self.column if self.path is None else f"{self.column}[{self.path}]"


def classify_value(stored: str, keyring: Keyring) -> ValueClass:
    """The inventory category of a stored string, without decrypting it (Forge's ``inspect``)."""
    found = classify(stored)
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

    A plain column is one value (NULL or blank: none, as Forge). A ``json_paths`` column holds one
    value per path (absent, null or blank paths: none); a document that is not JSON is one
    unreadable value, a path holding a non-string is an unreadable value at that path.
    """
    if text is None:
        return []
    if not paths:
        return [] if is_blank(text) else [(ValueField(column), text)]
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
        if path in found and not is_blank(found[path]):
            out.append((ValueField(column, path), found[path]))
    return out


def length_after(stored: str, value: ValueClass, active_key: str) -> int | None:
    """Characters the value will have once migrated to ``active_key``; None if it is never rewritten.

    Known from the stored form alone: the same plaintext under another key of the same algorithm
    has as many blocks, written as base64 (a hex payload only gets shorter).
    """
    if value.category == "ACTIVE":
        return len(stored)
    prefix = FPC1_OVERHEAD + len(active_key)
    payload = stored.split(":", 3)[3] if value.category in ("HISTORICAL", "UNKNOWN_KEY") else stored
    if value.category not in ("HISTORICAL", "UNKNOWN_KEY", "LEGACY"):
        return None
    try:
        return prefix + len(encode_payload(decode_payload(payload)))
    except CiphertextInvalid:
        return prefix + len(payload)
