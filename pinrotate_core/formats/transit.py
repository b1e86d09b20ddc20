"""The ``vault-transit`` format: ``vault:v<N>:<base64>`` as Vault / OpenBao Transit writes it.

Only the key version is read here (selection, inventory, gate); the payload stays opaque, because
plaintext never leaves Vault (re-encryption is Transit ``rewrap``). Errors never echo the value.
"""

from __future__ import annotations

import base64
import binascii
import re

from ..errors import CiphertextInvalid

PREFIX = "vault:v"
# Version: a positive integer without leading zeros, as Transit writes it.
_TRANSIT = re.compile(r"vault:v([1-9][0-9]{0,9}):([A-Za-z0-9+/]+={0,2})")


def transit_version(value: str | bytes | memoryview) -> int:
    """The key version ``N`` of ``vault:v<N>:<base64>``; ``CiphertextInvalid`` when not in that form."""
    text = _as_text(value)
    match = _TRANSIT.fullmatch(text) if text is not None else None
    if match is None:
        raise CiphertextInvalid("value is not a vault-transit ciphertext (vault:v<N>:<base64>)")
    try:
        base64.b64decode(match.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise CiphertextInvalid("vault-transit ciphertext payload is not valid base64") from None
    return int(match.group(1))


def transit_version_or_none(value: str | bytes | memoryview | None) -> int | None:
    """For inventory: the version, or None when the value is NULL or not parseable (UNKNOWN)."""
    if value is None:
        return None
    try:
        return transit_version(value)
    except CiphertextInvalid:
        return None


def is_transit(value: str | bytes | memoryview | None) -> bool:
    return transit_version_or_none(value) is not None


def _as_text(value: str | bytes | memoryview) -> str | None:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("ascii")
    except UnicodeDecodeError:
        return None
