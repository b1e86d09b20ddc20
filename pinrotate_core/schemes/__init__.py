"""Ciphertext schemes: one module each, one registry from ``format = "..."`` to its scheme.

- ``aesgcm``: row-versioned AES-GCM (``schemes.aesgcm``).
- ``fpc1``: self-describing ``FPC1:`` values, legacy forms and JSON fields (``schemes.fpc1``).
- ``vault-transit``: ``vault:v<N>:`` values rewrapped by Transit (``schemes.transit``).

The drain and the inventory see only the ``Scheme`` protocol (``schemes.base``); this registry is
the one place that maps a format name to an implementation. Adding a scheme touches this package
only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Final

from ..config import KeysSettings
from ..errors import ConfigError
from ..keyring import Keyring
from ..targets import ResolvedTarget
from .aesgcm import AesGcmScheme
from .base import Scheme, WriteGuard
from .fpc1 import Fpc1Scheme
from .fpc1_values import Fpc1CipherSet
from .transit import TransitScheme

# (resolved target, the run's keyring, [keys] settings, the provider as Rewrapper port) -> Scheme
SchemeFactory = Callable[[ResolvedTarget, Keyring, KeysSettings, object], Scheme]

SCHEMES: Final[dict[str, SchemeFactory]] = {
    "aesgcm": lambda target, keyring, keys, provider: AesGcmScheme(target, keyring),
    "fpc1": lambda target, keyring, keys, provider: Fpc1Scheme(
        target, keyring, legacy_format=keys.legacy_format, legacy_read_enabled=keys.legacy_read_enabled,
        legacy_plaintext=keys.legacy_plaintext),
    "vault-transit": lambda target, keyring, keys, provider: TransitScheme(target, keyring, provider),
}


def write_guard(format_name: str) -> WriteGuard:
    """The write guard of a format's scheme, without binding one (``lock`` for a format not known)."""
    return {"aesgcm": AesGcmScheme.guard, "fpc1": Fpc1Scheme.guard, "vault-transit": TransitScheme.guard}.get(
        format_name, "lock")


def build_scheme(target: ResolvedTarget, keyring: Keyring, keys: KeysSettings, provider: object = None) -> Scheme:
    """The scheme of ``target``'s format, bound to it; ConfigError when the keyring cannot serve it."""
    factory = SCHEMES.get(target.settings.format)
    if factory is None:
        raise ConfigError(f"target {target.name}: format {target.settings.format} is not known")
    return factory(target, keyring, keys, provider)


def check_keyring(formats: Collection[str], keyring: Keyring, keys: KeysSettings) -> None:
    """Refuse at start a keyring that some configured format cannot use (before any target is read)."""
    if {"aesgcm", "vault-transit"} & set(formats):
        keyring.current_version  # noqa: B018 - raises ConfigError when current is not an integer version
    if "fpc1" in formats:
        # 16-byte keys with well-formed ids, or the start stops here rather than in a target's drain.
        Fpc1CipherSet(keyring, legacy_format=keys.legacy_format)


__all__ = ["SCHEMES", "Scheme", "build_scheme", "check_keyring", "write_guard"]
