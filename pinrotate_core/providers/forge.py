"""``forge`` provider: the persistent keyring of a Forge installation, read where Forge keeps it.

Forge's bootstrap file (a Java properties file) overlaid with ``FORGE_CRYPTO_PERSISTENCE_*``
environment variables, with Forge's precedence (environment over file) and Forge's validation.
Read-only: the file is parsed by ``javaproperties`` and never written, created, locked or moved.
Legacy values are read as Forge reads them: with ``legacy-key``, else with the transport key
``forge.crypto.secret-key`` (file, or ``FORGE_CRYPTO_SECRET_KEY``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import javaproperties

from ..errors import ConfigError
from ..keyring import Key, KeyPolicy, Keyring, shown_key_id, shown_name, validate_key_id
from ._material import decode_key, read_private_file

DEFAULT_FILE = "~/.forge/secrets/crypto.properties"
FILE_ENV = "FORGE_CRYPTO_BOOTSTRAP_FILE"
PERSISTENCE = "forge.crypto.persistence."
SECRET_KEY = "forge.crypto.secret-key"
SECRET_KEY_ENV = "FORGE_CRYPTO_SECRET_KEY"
TRANSPORT = "transport-key"  # where the transport key is kept among the settings read
ENV_PREFIX = "FORGE_CRYPTO_PERSISTENCE_"
KEYS_PREFIX = "keys."
ENV_KEYS_PREFIX = "KEYS_"
# Forge's persistent keys are 16 bytes (AES-128 / SM4); the legacy key was bound to the transport
# key in older releases, whose length follows its algorithm.
PERSISTENT_KEY_LENGTH = 16
SETTINGS = ("enabled", "write-versioned", "legacy-read-enabled", "legacy-key", "active-key-id", "active-key")
# Written by Forge's bootstrapper on first start; a file or environment without one of them is
# incomplete, as Forge itself refuses to start on it.
REQUIRED = ("enabled", "write-versioned", "legacy-read-enabled", "active-key-id", "active-key")
# Spring's StringToBooleanConverter, case-insensitive.
_TRUE = frozenset({"true", "on", "yes", "1"})
_FALSE = frozenset({"false", "off", "no", "0"})


@dataclass(frozen=True)
class _Setting:
    value: str
    origin: str  # a file setting ("<file>: forge.crypto.persistence.x") or a variable name; never a value


def env_names(setting: str) -> tuple[str, ...]:
    """The environment variables Spring binds to ``forge.crypto.persistence.<setting>``: the
    underscore form Forge documents (``..._ACTIVE_KEY_ID``) and Spring's canonical one (``..._ACTIVEKEYID``)."""
    upper = setting.upper()
    return tuple(dict.fromkeys((ENV_PREFIX + upper.replace("-", "_"), ENV_PREFIX + upper.replace("-", ""))))


def env_key_id(variable: str) -> str:
    """The key id Spring's relaxed binding gives ``FORGE_CRYPTO_PERSISTENCE_KEYS_<ID>``: lower-cased,
    underscores as dots (which Forge's id rule then refuses)."""
    return variable[len(ENV_PREFIX) + len(ENV_KEYS_PREFIX):].lower().replace("_", ".")


def _bool_flag(name: str, text: str | None) -> bool | None:
    if text is None or not text.strip():
        return None
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name}: must be true or false")


class ForgeKeyProvider:
    """Forge's keyring: active key, historical keys (read-only), legacy key, and its fpc1 switches.

    The bootstrap file is read unless Forge itself would skip it: a non-empty
    ``FORGE_CRYPTO_SECRET_KEY`` or ``FORGE_CRYPTO_BOOTSTRAP_ENABLED=false`` in the environment make
    Forge take every key from its explicit configuration, and so does pinrotate.
    """

    def __init__(self, path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ
        env = self._env()
        if path is None:
            path = env.get(FILE_ENV) or DEFAULT_FILE
        self.path = Path(path).expanduser()
        self.description = f"forge {self.path}"

    def _env(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    # -- reading -------------------------------------------------------------------------------

    def load_keyring(self) -> Keyring:
        env = self._env()
        skipped = self._bootstrap_skipped(env)
        settings: dict[str, _Setting] = {} if skipped else self._file_settings()
        overridden = self._overlay_environment(settings, env)
        source = (f"forge environment FORGE_CRYPTO_PERSISTENCE_* (bootstrap file skipped: {skipped})" if skipped
                  else self.description)
        if overridden:
            source += f" (overridden by {', '.join(sorted(overridden))})"
        return self._keyring(settings, source)

    def _bootstrap_skipped(self, env: Mapping[str, str]) -> str | None:
        """Why Forge would not read its bootstrap file here, or None when it would."""
        if env.get("FORGE_CRYPTO_SECRET_KEY", "").strip():
            return "FORGE_CRYPTO_SECRET_KEY is set"
        if _bool_flag("FORGE_CRYPTO_BOOTSTRAP_ENABLED", env.get("FORGE_CRYPTO_BOOTSTRAP_ENABLED")) is False:
            return "FORGE_CRYPTO_BOOTSTRAP_ENABLED is false"
        return None

    def _file_settings(self) -> dict[str, _Setting]:
        """The persistence settings of the bootstrap file, each with its line number. A line that
        is not one is refused by its number and the form expected, never quoted: a damaged line
        (a separator lost, a key's base64 alone on a line) may be nothing but a key."""
        if not self.path.exists():
            raise ConfigError(f"{self.path}: Forge bootstrap file not found; Forge's bootstrapper creates it on"
                              f" Forge's first start (pinrotate never writes it): set [keys] file or {FILE_ENV}")
        raw = read_private_file(self.path, what="Forge bootstrap file")
        out: dict[str, _Setting] = {}
        line = 1
        try:
            # Java's Properties.load(InputStream) reads ISO-8859-1; javaproperties does the same with bytes.
            for element in javaproperties.parse(raw):
                at, line = line, line + element.source.count("\n")
                if isinstance(element, javaproperties.KeyValue):
                    self._file_setting(out, element.key, element.value, at)
        except ValueError:  # InvalidUEscapeError: its text may quote the file; leave it out
            raise ConfigError(f"{self.path}: line {line}: not a valid Java properties line (bad \\u escape);"
                              " it was left as it is") from None
        return out

    def _file_setting(self, out: dict[str, _Setting], name: str, value: str, line: int) -> None:
        where = f"{self.path}: line {line}"
        if name == SECRET_KEY:  # the transport key: Forge reads legacy values with it when legacy-key is unset
            out[TRANSPORT] = _Setting(value, f"{where}: {SECRET_KEY}")
            return
        if name.startswith("forge.crypto.bootstrap."):
            return  # the bootstrapper's own switches
        rest = name[len(PERSISTENCE):] if name.startswith(PERSISTENCE) else None
        if rest in SETTINGS:
            out[rest] = _Setting(value, f"{where}: {name}")
        elif rest is not None and rest.startswith(KEYS_PREFIX):
            key_id = rest[len(KEYS_PREFIX):]
            validate_key_id(key_id, where=f"{where} (expected {PERSISTENCE}keys.<id>=<base64 of 16 bytes>; the"
                                          " line is not shown, it may hold a key)")
            out[rest] = _Setting(value, f"{where}: {PERSISTENCE}keys.{shown_key_id(key_id)}")
        else:
            shown = name if shown_name(name) == name else "(the line is not shown: it may hold a key)"
            raise ConfigError(f"{where}: unknown setting {shown} in Forge bootstrap file (expected"
                              f" {PERSISTENCE}<setting>=<value> or {PERSISTENCE}keys.<id>=<base64>; Forge refuses"
                              " to start on it too); it was left as it is")

    def _overlay_environment(self, settings: dict[str, _Setting], env: Mapping[str, str]) -> list[str]:
        """Environment over file, as in Forge; returns the names of the variables that were used."""
        used: list[str] = []
        if env.get(SECRET_KEY_ENV, "").strip():
            settings[TRANSPORT] = _Setting(env[SECRET_KEY_ENV], SECRET_KEY_ENV)
            used.append(SECRET_KEY_ENV)
        by_variable = {var: setting for setting in SETTINGS for var in env_names(setting)}
        for var in sorted(env):
            value = env[var]
            if not var.startswith(ENV_PREFIX) or not value.strip():
                continue  # an empty variable (a compose default like ${X:-}) sets nothing
            if var.startswith(ENV_PREFIX + ENV_KEYS_PREFIX) and len(var) > len(ENV_PREFIX + ENV_KEYS_PREFIX):
                key_id = env_key_id(var)
                if "." in key_id:
                    raise ConfigError(f"{shown_name(var)}: Spring's relaxed binding reads this as key id"
                                      f" {shown_name(key_id)!r} (lower-cased, _ as .), which Forge refuses: key ids"
                                      " must match [A-Za-z0-9_-]{1,32}")
                key = KEYS_PREFIX + key_id
            elif var in by_variable:
                key = by_variable[var]
            else:
                raise ConfigError(f"{shown_name(var)}: unknown Forge persistence setting (known: "
                                  f"{', '.join(env_names(s)[0] for s in SETTINGS)}, {ENV_PREFIX}KEYS_<ID>)")
            previous = settings.get(key)
            if previous is not None and previous.origin.startswith(ENV_PREFIX) and previous.value != value:
                raise ConfigError(f"{shown_name(var)} and {previous.origin} both set {PERSISTENCE}{key}, differently")
            settings[key] = _Setting(value, shown_name(var))
            used.append(var)
        return used

    def _keyring(self, settings: Mapping[str, _Setting], source: str) -> Keyring:
        where = "Forge keyring" if source.startswith("forge environment") else str(self.path)
        for name in REQUIRED:
            if name not in settings:
                raise ConfigError(f"{where}: {PERSISTENCE}{name} is missing (or set {env_names(name)[0]})")
        active_id = settings["active-key-id"]
        validate_key_id(active_id.value.strip(), where=active_id.origin)
        current = active_id.value.strip()
        keys: dict[str, Key] = {current: _persistent_key(current, settings["active-key"])}
        for name, setting in settings.items():
            if not name.startswith(KEYS_PREFIX):
                continue
            key_id = name[len(KEYS_PREFIX):]
            validate_key_id(key_id, where=setting.origin)
            key = _persistent_key(key_id, setting)
            if key_id in keys and keys[key_id] != key:
                raise ConfigError(f"{setting.origin}: historical key {shown_key_id(key_id)} differs from the active"
                                  f" key of the same id ({active_id.origin})")
            keys[key_id] = key
        legacy = None
        for name in ("legacy-key", TRANSPORT):  # as Forge: legacy-key, else the transport key
            if name in settings and settings[name].value.strip():
                legacy = decode_key("legacy", settings[name].value, where=settings[name].origin)
                break
        flags = {name: _bool_flag(settings[name].origin, settings[name].value)
                 for name in ("enabled", "write-versioned", "legacy-read-enabled")}
        for name, flag in flags.items():
            if flag is None:
                raise ConfigError(f"{settings[name].origin}: must be true or false")
        policy = KeyPolicy(
            enabled=bool(flags["enabled"]), write_versioned=bool(flags["write-versioned"]),
            legacy_read_enabled=bool(flags["legacy-read-enabled"]),
            enabled_setting=_setting_name(settings["enabled"], "enabled"),
            write_versioned_setting=_setting_name(settings["write-versioned"], "write-versioned"),
            legacy_read_enabled_setting=_setting_name(settings["legacy-read-enabled"], "legacy-read-enabled"),
        )
        return Keyring(current=current, keys=keys, legacy=legacy, source=source, policy=policy)


def _persistent_key(key_id: str, setting: _Setting) -> Key:
    key = decode_key(key_id, setting.value, where=setting.origin)
    if len(key.material) != PERSISTENT_KEY_LENGTH:
        raise ConfigError(f"{setting.origin}: key {key_id} must be base64 of 16 bytes (AES-128 / SM4),"
                          f" got {len(key.material)}")
    return key


def _setting_name(setting: _Setting, name: str) -> str:
    """``forge.crypto.persistence.<name>`` and where it was set, for a refusal message."""
    if setting.origin.startswith(ENV_PREFIX):
        return setting.origin
    return f"{PERSISTENCE}{name} ({setting.origin.rsplit(': ', 1)[0]})"
