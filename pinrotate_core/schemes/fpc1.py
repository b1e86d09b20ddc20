"""The ``fpc1`` scheme: ``FPC1:<algorithm>:<keyId>:<base64(nonce||ct||tag)>``, its read-only legacy
forms and its JSON fields.

Self-describing values: the key id lives in the value, so every value of a row is decided alone
and counted alone. Rows are read without locks and written with compare-and-swap on the value
read; a value the application changed meanwhile is a CONFLICT, never overwritten. Legacy values
(``aesgcm-b64``: nonce || ct || tag; ``aes-ecb-b64``: AES-ECB/PKCS#7, authenticated by nothing
but its padding and, with ``legacy_plaintext = "utf8"``, its plaintext being UTF-8) are read and
rewritten as FPC1 ``AES-GCM``; nothing is ever written in a legacy form. No error message here
contains a value, a plaintext or a key.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NoReturn

from cryptography.exceptions import UnsupportedAlgorithm
from psycopg import sql

from .._primitives import NONCE_LEN, TAG_LEN, AesEcbPkcs7, AesGcm, Sm4Gcm
from ..errors import CiphertextInvalid, ConfigError, KeyUnavailable, VerificationFailed
from ..keyring import KEY_ID_PATTERN, Key, Keyring
from ..targets import Column, ResolvedTarget
from ._json_paths import json_values_in, replace_json_values
from .base import (
    DECRYPT_FAILED,
    LEGACY_KEY,
    STALE,
    UNKNOWN_KEY,
    UNKNOWN_VALUE,
    BatchPlan,
    FailedRow,
    ValueClass,
    Write,
    WriteGuard,
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


class Fpc1Scheme:
    """``fpc1`` bound to one target and the run's keyring (see the module docstring).

    Per value, in scope: ACTIVE is skipped (a run can be repeated); HISTORICAL, and LEGACY when
    ``legacy_read_enabled``, are re-encrypted (an FPC1 value keeps its algorithm, a legacy value
    becomes ``AES-GCM``); LEGACY with legacy reading off is counted (``legacy_left``) and left
    alone; UNKNOWN is counted and left alone; UNKNOWN_KEY (or legacy with no legacy key) is a
    failed row with reason ``unknown_key``; a value that does not decrypt one with
    ``decrypt_failed``. A JSON column is rewritten once, with every field of it that moves.
    """

    name = "fpc1"
    guard: WriteGuard = "cas"
    counts_values = True

    def __init__(self, target: ResolvedTarget, keyring: Keyring, *, legacy_format: str = DEFAULT_LEGACY_FORMAT,
                 legacy_read_enabled: bool = False, legacy_plaintext: LegacyPlaintext = "utf8") -> None:
        self.target = target
        self.keyring = keyring
        self.current_key = keyring.current
        self.legacy_format: LegacyFormat = check_legacy_format(legacy_format)
        self.legacy_read_enabled = legacy_read_enabled
        self.legacy_plaintext: LegacyPlaintext = legacy_plaintext
        # Built now: a keyring fpc1 cannot use (bad key length or id) stops the start.
        self._ciphers: dict[Algorithm, Fpc1CipherSet] = {"AES-GCM": self._cipher_set("AES-GCM")}
        self._paths = {c.name: tuple(target.settings.json_paths.get(c.name, ())) for c in target.columns}
        self._active_prefixes = [f"{PREFIX}:{a}:{keyring.current}:" for a in ALGORITHMS]
        self._deep_ciphers: Fpc1CipherSet | None = None

    def _cipher_set(self, algorithm: Algorithm, *, legacy_read_enabled: bool | None = None) -> Fpc1CipherSet:
        enabled = self.legacy_read_enabled if legacy_read_enabled is None else legacy_read_enabled
        return Fpc1CipherSet(self.keyring, algorithm=algorithm, legacy_format=self.legacy_format,
                             legacy_read_enabled=enabled, legacy_plaintext=self.legacy_plaintext)

    def _ref(self, name: str, alias: str | None) -> sql.Identifier:
        return sql.Identifier(alias, name) if alias else sql.Identifier(name)

    def values(self, column: Column, text: str | None) -> list[tuple[ValueField, str | None]]:
        return values_of_column(column.name, self._paths[column.name], text)

    def classify(self, stored: str | None) -> ValueClass:
        return UNKNOWN_VALUE if stored is None else classify_value(stored, self.keyring, self.legacy_format)

    def rewrite(self, stored: str, value: ValueClass) -> str:
        """``stored`` under the active key, verified; FPC1 keeps its algorithm, legacy becomes AES-GCM."""
        algorithm: Algorithm = parse_fpc1(stored).algorithm if value.category != "LEGACY" else "AES-GCM"
        ciphers = self._ciphers.get(algorithm)
        if ciphers is None:
            try:
                ciphers = self._ciphers[algorithm] = self._cipher_set(algorithm)
            except ConfigError as e:  # e.g. an OpenSSL without SM4
                raise KeyUnavailable(f"target {self.target.name}: {e}", retryable=False) from None
        try:
            return ciphers.reencrypt_to_current(stored)
        except VerificationFailed:
            raise KeyUnavailable(f"target {self.target.name}: a value re-encrypted under key "
                                 f"{self.keyring.current} did not verify", retryable=False) from None

    # -- Scheme --------------------------------------------------------------------------------

    def stale_condition(self, alias: str | None = None) -> sql.Composable:
        """A plain column not starting with an active prefix, or any JSON column (its fields are
        only known once parsed)."""
        conds: list[sql.Composable] = []
        for column in self.target.columns:
            ref = self._ref(column.name, alias)
            if self._paths[column.name]:
                conds.append(sql.SQL("{} IS NOT NULL").format(ref))
                continue
            not_active = [sql.SQL("NOT starts_with({}::text, {})").format(ref, sql.Literal(p))
                          for p in self._active_prefixes]
            conds.append(sql.SQL("({} IS NOT NULL AND {})").format(ref, sql.SQL(" AND ").join(not_active)))
        return sql.SQL("({})").format(sql.SQL(" OR ").join(conds))

    def read_list(self, alias: str | None = None) -> list[sql.Composable]:
        t = self.target.settings
        tenant: sql.Composable = sql.SQL("{}::text").format(self._ref(t.tenant, alias)) if t.tenant else sql.SQL("NULL::text")
        # json/jsonb are read as their text, which the JSON rewrite works on.
        return [tenant, *(sql.SQL("{}::text").format(self._ref(c.name, alias)) for c in self.target.columns)]

    def key_version_column(self) -> Column | None:
        return None

    def plan(self, rows: Sequence[Sequence[Any]], known_failed: Collection[str] = ()) -> BatchPlan:
        """Decide every value of ``rows`` = ``(id, tenant, *column texts)``; each value alone: in a
        row with two stale fields one may move and the other fail."""
        target = self.target.name
        plan = BatchPlan()
        writes = {j: Write((j,)) for j in range(len(self.target.columns))}
        can_read_legacy = self.legacy_read_enabled and self.keyring.legacy is not None
        for row in rows:
            row_id, tenant = row[0], row[1]
            problems: dict[str, list[str]] = {}
            for j, (column, text) in enumerate(zip(self.target.columns, row[2:])):
                replacements: dict[str | None, str] = {}
                for value_field, stored in self.values(column, text):
                    value = self.classify(stored)
                    if value.category in ("ACTIVE", "UNKNOWN"):
                        plan.count(value.category.lower())
                        continue
                    assert stored is not None
                    plan.count("stale")
                    if value.category == "LEGACY" and not self.legacy_read_enabled:
                        plan.count("legacy_left")
                        continue
                    if value.category == "UNKNOWN_KEY" or (value.category == "LEGACY" and not can_read_legacy):
                        plan.count("unknown_key")
                        problems.setdefault(UNKNOWN_KEY, []).append(value_field.label)
                        continue
                    try:
                        replacements[value_field.path] = self.rewrite(stored, value)
                    except CiphertextInvalid:
                        problems.setdefault(DECRYPT_FAILED, []).append(value_field.label)
                    except KeyUnavailable:
                        plan.count("unknown_key")
                        problems.setdefault(UNKNOWN_KEY, []).append(value_field.label)
                if not replacements:
                    continue
                assert text is not None
                if not self._paths[column.name]:
                    new_text = replacements[None]
                else:
                    try:
                        new_text = replace_json_values(text, {p: v for p, v in replacements.items() if p is not None})
                    except (CiphertextInvalid, LookupError, ConfigError):
                        # e.g. a key on the path occurs twice: which copy the application reads is not ours to guess.
                        problems.setdefault(JSON_REWRITE_REFUSED, []).extend(
                            f"{column.name}[{p}]" for p in replacements if p is not None)
                        continue
                writes[j].add(row_id, [new_text], [text], weight=len(replacements),
                              tenant="" if tenant is None else str(tenant))
            for reason, labels in problems.items():
                plan.failed.append(FailedRow(target, str(row_id), tuple(labels), reason))
        plan.writes = [w for w in writes.values() if w.ids]
        return plan

    def stale_values(self, row: Sequence[Any]) -> int:
        return sum(1 for column, text in zip(self.target.columns, row[1:])
                   for _, stored in self.values(column, text)
                   if stored is not None and self.classify(stored).category in STALE)

    def settled(self, column: Column, read: Any, now: Any) -> bool:
        """True when ``now`` is ``read`` moved by another run: every value on the active key with the
        same plaintext, nothing else in the document changed. An application's edit is not."""
        before = dict(self.values(column, read))
        after = dict(self.values(column, now))
        if not after or before.keys() != after.keys():
            return False
        ciphers = self._deep_ciphers = self._deep_ciphers or self._cipher_set("AES-GCM", legacy_read_enabled=True)
        for where, value in after.items():
            old = before[where]
            if value is None or old is None or self.classify(value).category != "ACTIVE":
                return False
            try:
                if value != old and ciphers.decrypt(value) != ciphers.decrypt(old):
                    return False
            except (CiphertextInvalid, KeyUnavailable):
                return False
        if self._paths[column.name]:
            try:
                restored = replace_json_values(str(now), {f.path: str(before[f]) for f in after if f.path is not None})
            except (CiphertextInvalid, LookupError, ConfigError):
                return False
            return bool(restored == read)
        return True

    def value_keys_sql(self, alias: str) -> list[tuple[sql.Composable, sql.Composable]] | None:
        return None  # key ids live inside values (and JSON documents): counted value by value

    def classify_key(self, key: str | None) -> ValueClass:
        if key is None:
            return UNKNOWN_VALUE
        if key == LEGACY_KEY:
            return ValueClass("LEGACY", key)
        if key == self.keyring.current:
            return ValueClass("ACTIVE", key)
        return ValueClass("HISTORICAL" if key in self.keyring.keys else "UNKNOWN_KEY", key)

    def inspect(self, row: Sequence[Any], deep: bool) -> Iterator[tuple[ValueClass, bool]]:
        # Deep reading decrypts legacy values whenever the keyring has the legacy key, whatever
        # legacy_read_enabled says: counting is not migrating.
        ciphers = None
        if deep:
            ciphers = self._deep_ciphers = self._deep_ciphers or self._cipher_set("AES-GCM", legacy_read_enabled=True)
        for column, text in zip(self.target.columns, row[1:]):
            for _, stored in self.values(column, text):
                value = self.classify(stored)
                failed = False
                if (ciphers is not None and stored is not None
                        and value.category in ("ACTIVE", "HISTORICAL", "LEGACY")
                        and not (value.category == "LEGACY" and self.keyring.legacy is None)):
                    try:
                        ciphers.decrypt(stored)
                    except CiphertextInvalid:
                        failed = True
                    except KeyUnavailable:
                        pass  # cannot happen for the categories tried; UNKNOWN_KEY is counted already
                yield value, failed

    def growth(self, column: Column) -> int:
        return max(len(self._paths[column.name]), 1) * (FPC1_OVERHEAD + len(self.current_key) + MAX_PAYLOAD_GROWTH)

    def length_after(self, column: Column, stored: Any) -> int | None:
        """Length of a column value after migration (an upper bound for JSON documents)."""
        text = str(stored)
        growth = 0
        changed = False
        for _, value in self.values(column, text):
            if value is None:
                continue
            # The keyring is not needed to size a value: any key id but the active one is rewritten.
            found = classify(value, legacy_format=self.legacy_format)
            shape = (ValueClass("ACTIVE" if found.key_id == self.current_key else "HISTORICAL", found.key_id)
                     if found.kind == "fpc1" else
                     ValueClass("LEGACY", LEGACY_KEY) if found.kind == "legacy-candidate" else UNKNOWN_VALUE)
            after = length_after(value, shape, self.current_key, self.legacy_format)
            if after is not None and shape.category != "ACTIVE":
                growth += after - len(value)
                changed = True
        return len(text) + growth if changed else None

    def inventory_facts(self) -> dict[str, Any]:
        return {}

    def drift_condition(self, alias: str) -> sql.Composable | None:
        return None
