"""Ciphertext schemes: one module each; ``format = "..."`` names one of them.

- ``aesgcm``: row-versioned AES-GCM (``schemes.aesgcm``).
- ``fpc1``: Forge's self-describing ``FPC1:`` values, its legacy values and JSON fields (``schemes.fpc1``).
- ``vault-transit``: ``vault:v<N>:`` values rewrapped by Transit (``schemes.transit``).

This module is the list of format names and of what a target's settings must say for each: the
settings check a target's ``format`` against it before any scheme is imported, so it imports
nothing (config -> here; schemes -> config). ``schemes.registry`` maps each name to its class and
is the one place to add a scheme (``register``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class FormatRules:
    """What a target's settings must say for a format, checked when the settings are loaded."""

    needs_key_version: bool = False  # the integer key-version column is required
    json_paths: bool = False  # encrypted fields of json/jsonb columns may be named
    legacy_values: bool = False  # unversioned legacy values, whose algorithm legacy_algorithm names

# Filled by schemes.registry.register, which adds a scheme's name and rules with its class.
FORMATS: Final[dict[str, FormatRules]] = {
    "aesgcm": FormatRules(needs_key_version=True),
    "fpc1": FormatRules(json_paths=True, legacy_values=True),
    "vault-transit": FormatRules(),
}
DEFAULT_FORMAT: Final = "aesgcm"


def known_formats() -> list[str]:
    return sorted(FORMATS)


__all__ = ["DEFAULT_FORMAT", "FORMATS", "FormatRules", "known_formats"]
