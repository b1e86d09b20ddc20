"""Decoding of base64 key material shared by the local providers."""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path

from ..errors import ConfigError
from ..keyring import VALID_KEY_LENGTHS, Key, is_version, shown_key_id, validate_key_id


def decode_key(key_id: str, encoded: object, *, where: str) -> Key:
    """A base64 key; errors name ``where`` and the key id (unless it could itself be key material),
    never the value. ``where`` must not quote the key source's text either."""
    validate_key_id(key_id, where=where)
    shown = shown_key_id(key_id)
    if not isinstance(encoded, str):
        raise ConfigError(f"{where}: key {shown} must be a base64 string")
    try:
        material = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{where}: key {shown} is not valid base64 (expected the standard base64 of the key,"
                          " with its = padding, and nothing else)") from None
    if len(material) not in VALID_KEY_LENGTHS:
        raise ConfigError(f"{where}: key {shown} must decode to 16, 24 or 32 bytes, got {len(material)}")
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


def read_private_file(path: Path, *, what: str) -> bytes:
    """The bytes of a key file that only its owner can reach, as ssh treats a private key.

    Refused (``ConfigError``, one line with the fix) when group or others have any permission bit or
    when another user owns it. The mode is checked on the opened file, so a swap between the check
    and the read cannot slip a different file in. Shared by every provider that reads key files.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot open {what} ({e.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: {what} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{path}: {what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()});"
                              " refusing it, as ssh refuses such a key: run as its owner")
        if st.st_mode & 0o077:
            raise ConfigError(f"{path}: {what} is accessible by group or others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); refusing it, as ssh refuses such a key:"
                              f" chmod 600 {path}")
        try:
            return fh.read()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read {what} ({e.strerror})") from None
