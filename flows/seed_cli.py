"""``seed``: a sample's tables and rows into the configured database (the Pin profile, or Forge's
tables with ``--preset forge``), refused where its tables exist."""

from __future__ import annotations

import argparse

from flows.reports import emit
from pinrotate_core import rotation
from pinrotate_core.commands import commands_for
from pinrotate_core.config import Settings
from pinrotate_core.errors import ConfigError


def cmd_seed(ns: argparse.Namespace, settings: Settings) -> int:
    from pinrotate_core.providers import build_provider

    if ns.preset == "forge":
        return _seed_forge(ns, settings)
    commands = commands_for(settings)  # the database engine's seed
    commands.reach(settings)  # on MySQL, an unreachable server is exit 4 before a keyring file is created
    # Seeding writes under the current key, so a file keyring that does not exist yet is created
    # here, as on a run's first start (never by a read: inventory, gate, keys list).
    keyring = build_provider(settings, create_keyring=True).load_keyring()
    summary = commands.seed_pin_profile(settings, keyring, rows=ns.rows, key_id=ns.key)
    doc = {"sample": "pin-profile", "key": summary.key_id, "rows": summary.total_rows, "tables": summary.counts,
           "drafts": summary.drafts}
    human = (f"seeded {summary.total_rows} rows of the Pin profile sample under key {summary.key_id} "
             f"({', '.join(f'{t}: {n}' for t, n in summary.counts.items())}; {summary.drafts} drafts)\n"
             "next: keys add, keys promote <new key>, then inventory and run")
    emit(ns, doc, human)
    return rotation.EXIT_OK


def _seed_forge(ns: argparse.Namespace, settings: Settings) -> int:
    if settings.keys.provider != "forge":
        raise ConfigError("seed --preset forge: needs [keys] provider = \"forge\" (see examples/forge.toml)")
    summary = commands_for(settings).seed_forge(settings, settings.keys.file_path, rows=ns.rows)
    doc = {"sample": "forge", "bootstrap_file": summary.bootstrap_file, "rows": summary.total_rows,
           "tables": summary.counts, "active_key": "k2"}
    human = (f"seeded {summary.total_rows} rows of Forge's tables ({', '.join(f'{t}: {n}' for t, n in summary.counts.items())})"
             f" and a sample Forge bootstrap file {summary.bootstrap_file} (active key k2, historical k1, legacy key)\n"
             "next: inventory, run --dry-run, run --expected-key-version k2, gate --retire legacy")
    emit(ns, doc, human)
    return rotation.EXIT_OK
