"""``env`` provider: ``PINROTATE_KEY_CURRENT=2``, ``PINROTATE_KEY_1=<base64>``, ``PINROTATE_KEY_2=...``."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import ConfigError
from ..keyring import Key, Keyring, check_key_ids, shown_key_id
from ._material import decode_key, normalise_current

PREFIX = "PINROTATE_KEY_"


class EnvKeyProvider:
    description = "env PINROTATE_KEY_*"

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ

    def load_keyring(self) -> Keyring:
        env = os.environ if self._environ is None else self._environ
        current_raw = env.get(PREFIX + "CURRENT")
        if not current_raw:
            raise ConfigError("keys.provider = env: PINROTATE_KEY_CURRENT is not set")
        current = normalise_current(current_raw, where="PINROTATE_KEY_CURRENT")
        keys: dict[str, Key] = {}
        legacy = None
        for name, value in env.items():
            if not name.startswith(PREFIX) or name == PREFIX + "CURRENT":
                continue
            key_id = name[len(PREFIX):]
            if key_id == "LEGACY":
                legacy = decode_key("legacy", value, where=name)
                continue
            keys[key_id] = decode_key(key_id, value, where=PREFIX + shown_key_id(key_id))
        check_key_ids(current, keys, where="keys.provider = env", name=lambda k: PREFIX + k)
        if current not in keys:
            shown = shown_key_id(current)
            raise ConfigError(f"PINROTATE_KEY_CURRENT names key {shown}, but PINROTATE_KEY_{shown} is not set")
        return Keyring(current=current, keys=keys, legacy=legacy, source=self.description)
