"""``keys add | promote | list | rotate``: manage the keyring without importing Prefect.

A new key is added read-only first and promoted in a second step, so that every reader has it
before anything is written with it. Output names key ids only, never material.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pinrotate_core.config import load_settings
from pinrotate_core.errors import ConfigError
from pinrotate_core.keyring import check_id_for_style
from pinrotate_core.log import log_event
from pinrotate_core.providers import KeyringAdmin, build_provider, keyring_style
from pinrotate_core.providers.file import FileKeyProvider

Emit = Callable[[argparse.Namespace, dict[str, Any], str], None]


def run(ns: argparse.Namespace, emit: Emit) -> int:
    settings = load_settings(ns.config)
    action = ns.keys_command
    # Only `keys add` may begin a keyring; list and promote refuse a missing one.
    provider = build_provider(settings, create_keyring=action == "add")
    if action == "list":
        ring = provider.load_keyring()
        doc = {"provider": provider.description, "current": ring.current, "keys": ring.ids(),
               "legacy": ring.legacy is not None}
        human = "\n".join([f"keyring {provider.description}"]
                          + [f"  {k}{'  (current)' if k == ring.current else ''}" for k in ring.ids()]
                          + (["  legacy (read-only)"] if ring.legacy is not None else []))
        emit(ns, doc, human)
        return 0
    if action == "rotate":
        rotate = getattr(provider, "rotate", None)
        if rotate is None:
            raise ConfigError(f"keys rotate: only for keys.provider = vault-transit (this is {settings.keys.provider})")
        latest = rotate()
        log_event("key_rotated", provider=provider.description, latest_version=latest)
        emit(ns, {"provider": provider.description, "latest_version": latest},
             f"transit key rotated: latest version is now {latest}; run the rotation to rewrap older values")
        return 0
    if not isinstance(provider, KeyringAdmin):
        raise ConfigError(f"keys {action}: keys.provider = {settings.keys.provider} is managed outside pinrotate")
    style = keyring_style(settings)
    if action == "add":
        if ns.key_id is not None:
            check_id_for_style(ns.key_id, style, where="keys add")
        # Only the file provider begins a keyring on a missing file: say so, with the ids it holds.
        created = isinstance(provider, FileKeyProvider) and not provider.path.exists()
        # The first key of a new keyring may be created here, so the keyring is read afterwards,
        # through a fresh provider (providers keep what they read for the rest of a run).
        key_id = provider.add_key(ns.key_id)
        ring = build_provider(settings).load_keyring()
        current = ring.current
        log_event("key_added", provider=provider.description, key=key_id, current=current)
        hint = ("it is the first key, and current" if key_id == current else
                f"read-only; current is still {current}.\n"
                f"When every reader has it: python -m flows.rotate keys promote {key_id}")
        added: dict[str, Any] = {"provider": provider.description, "added": key_id, "current": current}
        human = f"added key {key_id} ({hint})"
        if created:
            added.update(created=True, keys=ring.ids())
            human = (f"created the keyring {provider.description} (it did not exist) with keys "
                     f"{', '.join(ring.ids())}: key {current} current, ") + human
        emit(ns, added, human)
        return 0
    before = provider.load_keyring()
    if action == "promote":
        check_id_for_style(ns.key, style, where="keys promote")
        if ns.key == before.current:
            raise ConfigError(f"keys promote: key {ns.key} is already the current key of {provider.description}; "
                              "nothing was changed (add a new key first: keys add)")
        provider.promote(ns.key)
        log_event("key_promoted", provider=provider.description, key=ns.key, previous=before.current)
        emit(ns, {"provider": provider.description, "current": ns.key, "previous": before.current},
             f"key {ns.key} is now current (was {before.current}). The next run moves older rows to it.")
        return 0
    raise ConfigError(f"keys: unknown action {action}")
