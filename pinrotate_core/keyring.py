"""Keys and keyrings: which key is current, and every older key still needed to read.

A ``Key`` never shows its material: redacted ``repr``, and it refuses to be pickled, so it cannot
end up in a Prefect result, a log record or an exception by accident.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NoReturn

from .errors import ConfigError, KeyUnavailable

KEY_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,32}")
VALID_KEY_LENGTHS = (16, 24, 32)


class Key:
    """A key id and its secret material."""

    __slots__ = ("_material", "key_id")

    def __init__(self, key_id: str, material: bytes) -> None:
        if len(material) not in VALID_KEY_LENGTHS:
            raise ConfigError(f"key {key_id}: must be 16, 24 or 32 bytes, got {len(material)}")
        self.key_id = key_id
        self._material = bytes(material)

    @property
    def material(self) -> bytes:
        return self._material

    def __repr__(self) -> str:
        return f"Key(key_id={self.key_id!r}, material=<redacted {len(self._material)} bytes>)"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("Key objects cannot be pickled: key material never leaves the process")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other.key_id == self.key_id and other._material == self._material

    def __hash__(self) -> int:
        return hash(self.key_id)


_HEX_RUN = re.compile(r"[0-9A-Fa-f]{32}")
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{22,}")  # 22: a 16-byte key's base64 without its padding


def could_hold_key_material(text: str) -> bool:
    """True when ``text`` holds a run that could be a key written out: 32 hex digits, or 22 or more
    base64 characters mixing upper and lower case. A message never shows such text (issue 23: a
    damaged key file line was echoed, key and all)."""
    if _HEX_RUN.search(text):
        return True
    return any(run.lower() != run and run.upper() != run for run in _BASE64_RUN.findall(text))


def shown_key_id(key_id: str) -> str:
    """``key_id`` as a message may show it: itself when it is a valid key id that cannot be key
    material, else its length only."""
    if KEY_ID_PATTERN.fullmatch(key_id) and not could_hold_key_material(key_id):
        return key_id
    return f"<{len(key_id)} characters, not shown>"


def shown_name(name: str) -> str:
    """A setting or variable name read from a key source, as a message may show it: printable
    ASCII that cannot be key material, else its length only."""
    if name.isascii() and name.isprintable() and len(name) <= 100 and not could_hold_key_material(name):
        return name
    return f"<{len(name)} characters, not shown>"


def validate_key_id(key_id: str, *, where: str) -> str:
    if not KEY_ID_PATTERN.fullmatch(key_id):
        raise ConfigError(f"{where}: key id must match [A-Za-z0-9_-]{{1,32}}")
    return key_id


@dataclass(frozen=True)
class KeyPolicy:
    """fpc1 switches that the key source itself decides (Forge's own settings), overriding ``[keys]``.

    Each ``*_setting`` names where the value came from (a setting or variable name, never a value),
    so that a refusal points the operator at the place to change.
    """

    enabled: bool
    write_versioned: bool
    legacy_read_enabled: bool
    enabled_setting: str
    write_versioned_setting: str
    legacy_read_enabled_setting: str


@dataclass(frozen=True)
class Keyring:
    """The keys of one run. ``source`` names where they came from (never a secret)."""

    current: str
    keys: Mapping[str, Key]
    source: str
    legacy: Key | None = None
    # Set by providers that keep keys server-side (vault-transit): no local material at all.
    server_side: bool = field(default=False)
    # vault-transit only: versions below it no longer decrypt in Transit (inventory: UNKNOWN_KEY).
    min_decryption_version: int | None = None
    # Set by providers whose source also carries the fpc1 switches (forge): they override [keys].
    policy: KeyPolicy | None = None

    def __post_init__(self) -> None:
        if not self.server_side:
            check_key_ids(self.current, self.keys, where=self.source)
        if not self.server_side and self.current not in self.keys:
            raise ConfigError(f"{self.source}: current key {self.current} is not in the keyring")

    def key(self, key_id: str) -> Key:
        try:
            return self.keys[key_id]
        except KeyError:
            raise KeyUnavailable(f"key {key_id} is not in the keyring ({self.source})") from None

    @property
    def current_key(self) -> Key:
        return self.key(self.current)

    @property
    def current_version(self) -> int:
        """The current key as an integer version (``aesgcm`` and ``vault-transit`` targets)."""
        if not is_version(self.current):
            raise ConfigError(f"{self.source}: current key {self.current!r} is not a positive integer version")
        for key_id in self.keys:
            if is_version(key_id) and key_id != str(int(key_id)):
                # Rows name their version as an integer: key 02 would write version 2 and read key 2.
                raise ConfigError(f"{self.source}: key id {key_id} is key version {int(key_id)} with a leading zero;"
                                  f" rows name versions as integers, so name it {int(key_id)}")
        return int(self.current)

    def versions(self) -> list[int]:
        """Integer key versions held (``aesgcm``), ascending."""
        return sorted(int(k) for k in self.keys if is_version(k))

    def ids(self) -> list[str]:
        return sorted(self.keys, key=sort_key)

    def __repr__(self) -> str:
        return f"Keyring(current={self.current!r}, ids={self.ids()!r}, source={self.source!r})"


def _key_named(key_id: str) -> str:
    return f"key {key_id}"


def check_key_ids(current: str, ids: Iterable[str], *, where: str,
                  name: Callable[[str], str] = _key_named) -> None:
    """Refuse a keyring in which two ids name one key version (``2`` and ``02``), or whose current
    names a held version by another spelling (current ``02``, key ``2``): pinrotate would write under
    one spelling and read under the other. ``name`` says an id in the provider's own terms."""
    held = sorted(ids)
    by_version: dict[int, str] = {}
    for key_id in held:
        if is_version(key_id):
            first = by_version.setdefault(int(key_id), key_id)
            if first != key_id:
                raise ConfigError(f"{where}: {name(first)} and {name(key_id)} name the same key version"
                                  f" {int(key_id)}; keep one of them")
    if is_version(current) and current not in held and int(current) in by_version:
        spelled = by_version[int(current)]
        raise ConfigError(f"{where}: current names key {current}, but the keyring holds key version {int(current)}"
                          f" as {name(spelled)}; set current to {spelled}")


def is_version(key_id: str) -> bool:
    return key_id.isdigit() and int(key_id) > 0


def sort_key(key_id: str) -> tuple[int, int, str]:
    """Integer versions in numeric order first, then named ids alphabetically."""
    return (0, int(key_id), "") if is_version(key_id) else (1, 0, key_id)


def check_id_for_style(key_id: str, style: str, *, where: str) -> str:
    """Refuse a key id that a keyring of ``style`` cannot hold (``keys add``, ``keys promote``):
    a ``versions`` keyring (integer key versions, for ``aesgcm`` and ``vault-transit`` targets) holds
    only positive integers written without a leading zero; a ``named`` one any valid key id."""
    validate_key_id(key_id, where=where)
    if style == "versions" and not (is_version(key_id) and key_id == str(int(key_id))):
        raise ConfigError(f"{where}: key id {shown_key_id(key_id)} cannot name a key of this keyring: its targets "
                          "name keys by integer version (1, 2, 3, ...); nothing was changed")
    return key_id


def next_version(existing: Iterable[str]) -> str:
    versions = [int(k) for k in existing if is_version(k)]
    return str(max(versions, default=0) + 1)
