"""The self-describing ``fpc1`` format: ``FPC1:<algorithm>:<keyId>:<base64(nonce||ct||tag)>``.

Parses, classifies, decrypts (FPC1 and, when enabled, the read-only legacy forms) and encrypts
new values under the current key only. Also reads and rewrites string fields of JSON documents
(``json_paths`` targets) without touching anything else in the document. Never writes a legacy
value, and no error message here ever contains a value, a plaintext or a key.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NoReturn

from cryptography.exceptions import UnsupportedAlgorithm

from .._primitives import NONCE_LEN, TAG_LEN, AesGcm, Sm4Gcm
from ..errors import CiphertextInvalid, ConfigError, KeyUnavailable, VerificationFailed
from ..keyring import KEY_ID_PATTERN, Keyring
from .legacy import (
    DEFAULT_LEGACY_FORMAT,
    LegacyCipher,
    LegacyFormat,
    check_legacy_format,
    decode_base64_strict,
    legacy_blob_plausible,
)

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
    ) -> None:
        if keyring.server_side:
            raise ConfigError(f"{keyring.source}: fpc1 targets need local key material, not a server-side keyring")
        self.keyring = keyring
        self.algorithm: Algorithm = check_algorithm(algorithm)
        self.legacy_format: LegacyFormat = check_legacy_format(legacy_format)
        self.legacy_read_enabled = legacy_read_enabled
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
            self._legacy = LegacyCipher(self.keyring.legacy, self.legacy_format)
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


# --- JSON paths -------------------------------------------------------------------------------
#
# A small subset of JSONPath: ``$`` followed by ``.name``, ``['name']`` / ``["name"]`` and
# ``[index]`` steps, e.g. ``$.password``, ``$.auth.token``, ``$.fields[2].secret``. Rewrites work
# on the document's text, replacing only the bytes of the string at each path, so formatting,
# number spellings, escapes and key order elsewhere stay exactly as the application wrote them.

JsonStep = str | int

_STEP = re.compile(
    r"""\.(?P<name>[A-Za-z_][A-Za-z0-9_-]*)"""
    r"""|\[(?P<index>0|[1-9][0-9]*)\]"""
    r"""|\['(?P<sq>[^'\\]*)'\]"""
    r"""|\["(?P<dq>[^"\\]*)"\]"""
)
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class JsonPath:
    text: str
    steps: tuple[JsonStep, ...]

    def __str__(self) -> str:
        return self.text


def parse_json_path(path: str | JsonPath) -> JsonPath:
    """Parse ``$.a.b[2]['c d']``; ConfigError naming the path (paths are configuration, not values)."""
    if isinstance(path, JsonPath):
        return path
    if not path.startswith("$"):
        raise ConfigError(f"json path {path!r}: must start with $")
    steps: list[JsonStep] = []
    pos = 1
    while pos < len(path):
        m = _STEP.match(path, pos)
        if m is None:
            raise ConfigError(
                f"json path {path!r}: unsupported syntax at character {pos} "
                "(use .name, ['name'] or [index])"
            )
        if m.group("index") is not None:
            steps.append(int(m.group("index")))
        else:
            for group in ("name", "sq", "dq"):
                if m.group(group) is not None:
                    steps.append(m.group(group))
                    break
        pos = m.end()
    if not steps:
        raise ConfigError(f"json path {path!r}: must name a field, not the whole document")
    return JsonPath(path, tuple(steps))


_MISSING: Final = object()


def _step_into(node: Any, step: JsonStep) -> Any:
    if isinstance(step, int):
        if isinstance(node, list) and step < len(node):
            return node[step]
        return _MISSING
    if isinstance(node, dict) and step in node:
        return node[step]
    return _MISSING


def get_json_path(document: Any, path: str | JsonPath) -> Any:
    """The value at ``path`` in a parsed document; None when absent (like SQL NULL)."""
    node = document
    for step in parse_json_path(path).steps:
        node = _step_into(node, step)
        if node is _MISSING:
            return None
    return node


def set_json_path(document: Any, path: str | JsonPath, value: str) -> None:
    """Replace the existing value at ``path`` in a parsed document (in place; order kept)."""
    parsed = parse_json_path(path)
    node = document
    for step in parsed.steps[:-1]:
        node = _step_into(node, step)
        if node is _MISSING:
            raise LookupError(f"json path {parsed.text} does not exist in the document")
    last = parsed.steps[-1]
    if _step_into(node, last) is _MISSING:
        raise LookupError(f"json path {parsed.text} does not exist in the document")
    node[last] = value


def json_values_in(document: Any, paths: Iterable[str | JsonPath]) -> dict[str, str]:
    """The string at each path of a parsed document (``jsonb``); absent or null paths are skipped.

    A path holding anything but a string or null is CiphertextInvalid naming the path.
    """
    found: dict[str, str] = {}
    for path in paths:
        parsed = parse_json_path(path)
        value = get_json_path(document, parsed)
        if value is None:
            continue
        if not isinstance(value, str):
            raise CiphertextInvalid(f"json path {parsed.text} holds a {_json_type(value)}, not a ciphertext string")
        found[parsed.text] = value
    return found


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "value"


def _load_document(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        # from None: JSONDecodeError carries the whole document in ``.doc``.
        raise CiphertextInvalid("column value is not a JSON document") from None


def extract_json_values(text: str, paths: Iterable[str | JsonPath]) -> dict[str, str]:
    """The encrypted strings of a JSON text column, keyed by path; absent or null paths skipped."""
    return json_values_in(_load_document(text), paths)


def replace_json_values(text: str, replacements: Mapping[str, str]) -> str:
    """``text`` with the string at each path replaced; every other byte of the document is kept.

    Each path must hold a string (the one being replaced). A key that occurs twice in an object on
    a path is refused: which copy the application reads is not ours to guess.
    """
    document = _load_document(text)
    spans: list[tuple[int, int, str]] = []
    for path, new_value in replacements.items():
        parsed = parse_json_path(path)
        if not isinstance(get_json_path(document, parsed), str):
            raise LookupError(f"json path {parsed.text} does not hold a string in the document")
        start, end = _locate(text, parsed)
        spans.append((start, end, json.dumps(new_value)))
    spans.sort()
    for (_, end_a, _), (start_b, _, _) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ConfigError("json paths overlap: the same field is named twice")
    pieces: list[str] = []
    pos = 0
    for start, end, encoded in spans:
        pieces.append(text[pos:start])
        pieces.append(encoded)
        pos = end
    pieces.append(text[pos:])
    result = "".join(pieces)
    # Belt and braces: the rewrite must parse to the old document with just these strings changed.
    expected = _load_comparable(text)
    for path, new_value in replacements.items():
        set_json_path(expected, path, new_value)
    if _load_comparable(result) != expected:
        raise CiphertextInvalid("rewriting the JSON document changed more than the named fields")
    return result


@dataclass(frozen=True)
class _Constant:
    """NaN / Infinity as their spelling, so that two parses of one document compare equal."""

    spelling: str


def _load_comparable(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_Constant)
    except (json.JSONDecodeError, RecursionError):
        raise CiphertextInvalid("column value is not a JSON document") from None


def _skip_ws(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _value_end(text: str, pos: int) -> int:
    _, end = _DECODER.raw_decode(text, pos)
    return end


def _locate(text: str, path: JsonPath) -> tuple[int, int]:
    """Start and end offsets of the value at ``path`` in a JSON text already known to parse."""
    pos = _skip_ws(text, 0)
    for step in path.steps:
        pos = _member_start(text, pos, step, path) if isinstance(step, str) else _element_start(text, pos, step, path)
    return pos, _value_end(text, pos)


def _member_start(text: str, pos: int, name: str, path: JsonPath) -> int:
    if text[pos] != "{":
        raise LookupError(f"json path {path.text} does not exist in the document")
    found: int | None = None
    pos = _skip_ws(text, pos + 1)
    if text[pos] == "}":
        raise LookupError(f"json path {path.text} does not exist in the document")
    while True:
        # text[pos] is the opening quote of the member name: decode it as a JSON string.
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _skip_ws(text, pos)
        pos = _skip_ws(text, pos + 1)  # past ':'
        if key == name:
            if found is not None:
                raise CiphertextInvalid(f"json path {path.text}: a key on the path occurs twice in one object")
            found = pos
        pos = _skip_ws(text, _value_end(text, pos))
        if text[pos] == "}":
            break
        pos = _skip_ws(text, pos + 1)  # past ','
    if found is None:
        raise LookupError(f"json path {path.text} does not exist in the document")
    return found


def _element_start(text: str, pos: int, index: int, path: JsonPath) -> int:
    if text[pos] != "[":
        raise LookupError(f"json path {path.text} does not exist in the document")
    pos = _skip_ws(text, pos + 1)
    current = 0
    while text[pos] != "]":
        if current == index:
            return pos
        pos = _skip_ws(text, _value_end(text, pos))
        if text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        current += 1
    raise LookupError(f"json path {path.text} does not exist in the document")
