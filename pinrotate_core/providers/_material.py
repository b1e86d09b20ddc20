"""Decoding of base64 key material shared by the local providers."""

from __future__ import annotations

import base64
import binascii

from ..errors import ConfigError
from ..keyring import VALID_KEY_LENGTHS, Key, is_version, validate_key_id


def decode_key(key_id: str, encoded: object, *, where: str) -> Key:
    """A base64 key; errors name ``where`` and the key id, never the value."""
    validate_key_id(key_id, where=where)
    if not isinstance(encoded, str):
        raise ConfigError(f"{where}: key {key_id} must be a base64 string")
    try:
        material = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{where}: key {key_id} is not valid base64") from None
    if len(material) not in VALID_KEY_LENGTHS:
        raise ConfigError(f"{where}: key {key_id} must decode to 16, 24 or 32 bytes, got {len(material)}")
    return Key(key_id, material)


def normalise_current(value: object, *, where: str) -> str:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: current must be a key version or key id")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{where}: current must be a positive integer version")
        return str(value)
    if isinstance(value, str) and value.strip():
        text = value.strip()
        validate_key_id(text, where=f"{where}: current")
        if text.isdigit() and not is_version(text):
            raise ConfigError(f"{where}: current must be a positive integer version")
        return text
    raise ConfigError(f"{where}: current must be a key version or key id")
