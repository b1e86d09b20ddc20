"""The registry: ``format = "..."`` -> its scheme class, and the one public way to add a scheme.

The drain, the inventory, the run and the gate reach a scheme only through here (``build_scheme``,
``scheme_class``); a scheme registers with ``register``, which also tells the settings its name and
rules (``schemes.FORMATS``).
"""

from __future__ import annotations

from collections.abc import Collection

from ..config import KeysSettings
from ..errors import ConfigError
from ..keyring import Keyring
from ..targets import ResolvedTarget
from . import FORMATS, FormatRules, known_formats
from .aesgcm import AesGcmScheme
from .base import Scheme, SchemeClass, WriteGuard
from .fpc1 import Fpc1Scheme
from .transit import TransitScheme

_CLASSES: dict[str, SchemeClass] = {cls.name: cls for cls in (AesGcmScheme, Fpc1Scheme, TransitScheme)}


def register(scheme: SchemeClass, rules: FormatRules | None = None) -> None:
    """Make ``format = scheme.name`` mean ``scheme`` (``rules``: what its targets' settings must say).

    A name already taken by another class is refused: a format never changes meaning in a process.
    """
    known = _CLASSES.get(scheme.name)
    if known is not None and known is not scheme:
        raise ConfigError(f"format {scheme.name} is registered already")
    _CLASSES[scheme.name] = scheme
    FORMATS[scheme.name] = rules or FormatRules()


def scheme_class(format_name: str) -> SchemeClass:
    scheme = _CLASSES.get(format_name)
    if scheme is None:
        raise ConfigError(f"format {format_name} is not known (known: {', '.join(known_formats())})")
    return scheme


def write_guard(format_name: str) -> WriteGuard:
    """The write guard of a format's scheme, without binding one."""
    return scheme_class(format_name).guard


def reads_row_versions(format_name: str) -> bool:
    """Does a run of this format read each row's version (``targets.ROW_VERSION_COLUMNS``)? Its
    scheme's writes compare them (the ``version`` guard): a privilege a column grant must name."""
    return write_guard(format_name) == "version"


def build_scheme(target: ResolvedTarget, keyring: Keyring, keys: KeysSettings, provider: object = None) -> Scheme:
    """The scheme of ``target``'s format, bound to it: ``TargetBlocked`` when the target's columns
    cannot hold its values, ``ConfigError`` when the keyring cannot serve it."""
    return scheme_class(target.settings.format)(target, keyring, keys, provider)


def check_keyring(formats: Collection[str], keyring: Keyring, keys: KeysSettings) -> None:
    """Refuse at start a keyring that some configured format cannot use (before any target is read)."""
    for name in sorted(set(formats)):
        scheme_class(name).check_keyring(keyring, keys)


__all__ = ["build_scheme", "check_keyring", "register", "scheme_class", "write_guard"]
