"""The retire gate: may KEY be destroyed now (crypto-shredding)?

Open only when, over every target and tenant in scope, nothing is on KEY and nothing could be
hiding there: UNKNOWN + UNKNOWN_KEY + BLOCKED + FAILED + CONFLICT = 0 (contract §6). Values on
other old keys do not block KEY; out-of-scope rows do not block but are counted, because
destroying KEY crypto-erases them. A KEY the keyring does not hold, or the current key, is never
asked about: it is refused before anything is read (``check_retire_key``).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..inventory import Inventory, TargetInventory
from ..keyring import Keyring, is_version
from ..schemes.base import LEGACY_KEY

ALWAYS_BLOCKING = ("UNKNOWN", "UNKNOWN_KEY", "BLOCKED", "FAILED", "CONFLICT")


@dataclass
class GateReport:
    key: str
    open: bool
    blocking: dict[str, int]
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    current_key: str = ""
    # Filled by gate.retire.retire_gate for the change-ticket record (gate_record): where the verdict
    # was taken, on which keyring, over which scope. Names and counts only.
    database: dict[str, Any] = field(default_factory=dict)
    keyring_source: str = ""
    counts: dict[str, dict[str, Any]] = field(default_factory=dict)
    scope: dict[str, Any] = field(default_factory=dict)
    # How the gate made sure that what it read is on disk (see durability.confirm_flushed).
    durability: dict[str, Any] = field(default_factory=dict)
    # Whether KEY's check value was recorded in pinrotate.key_checks (when, by whom; never the value).
    key_identity: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        tenants = sorted({tn for t in self.targets.values() for tn in t.get("tenants", [])})
        out = {"key": self.key, "open": self.open, "blocking": self.blocking, "targets": self.targets,
               "current_key": self.current_key, "tenants": tenants, "application_version": application_version()}
        if self.durability:
            out["durability"] = self.durability
        if self.key_identity:
            out["key_identity"] = self.key_identity
        return out


class KeyNotRetirable(ConfigError):
    """``gate --retire KEY`` where the keyring does not hold KEY, or KEY is current (exit code 2)."""


def held_keys(keyring: Keyring) -> list[str]:
    """Every key the keyring holds, as ``gate --retire`` names them (``legacy`` last, when configured).

    ``vault-transit``: the versions Transit still decrypts, ``min_decryption_version`` to
    ``latest_version`` (what Transit lists under ``keys``); a version below it is already retired
    in Transit.
    """
    if keyring.server_side:
        held = [str(v) for v in range(keyring.min_decryption_version or 1, keyring.current_version + 1)]
    else:
        held = keyring.ids()
    if keyring.legacy is not None:
        held.append(LEGACY_KEY)
    return held


def describe_held(keyring: Keyring) -> str:
    if keyring.server_side:
        oldest, latest = keyring.min_decryption_version or 1, keyring.current_version
        versions = f"version {latest}" if oldest == latest else f"versions {oldest} to {latest}"
        return f"{keyring.source} holds {versions}"
    return f"{keyring.source} holds {', '.join(held_keys(keyring))}"


def check_retire_key(keyring: Keyring, key: str) -> None:
    """Refuse (exit 2) a KEY the keyring does not hold, and the current key: neither is a question
    the gate may answer "open" to (an unknown key counts zero everywhere; the current key is in use)."""
    if key not in held_keys(keyring):
        why = " (no legacy key is configured)" if key == LEGACY_KEY else ""
        raise KeyNotRetirable(f"key {key} is not in the keyring{why}; {describe_held(keyring)}")
    if key == keyring.current:
        then = "rotate the Transit key first" if keyring.server_side else "promote another key first"
        raise KeyNotRetirable(f"key {key} is the current key; {then}")


def application_version() -> str:
    """pinrotate's own version, kept with every gate report (the evidence names what produced it)."""
    try:
        return f"pinrotate {importlib.metadata.version('pinrotate')}"
    except importlib.metadata.PackageNotFoundError:
        return "pinrotate (not installed)"


def on_key_category(key: str, current: str) -> str:
    """The inventory category of values that sit on ``key`` when ``current`` is current."""
    if key == LEGACY_KEY:
        return "LEGACY"
    if key == current:
        return "ACTIVE"
    if is_version(key) and is_version(current) and int(key) > int(current):
        return "NEWER"
    return "HISTORICAL"


def target_blocking(inv: TargetInventory, key: str, current: str) -> tuple[dict[str, int], int, int]:
    """(blocking counts, values on KEY, out-of-scope values still on KEY) for one target."""
    blocking = {c: inv.counts[c] for c in ALWAYS_BLOCKING}
    on_key = inv.counts["LEGACY"] if key == LEGACY_KEY else inv.by_key.get(key, 0)
    excluded = inv.excluded_by_key.get(key, 0)
    category = on_key_category(key, current)
    blocking[category] = blocking.get(category, 0) + on_key
    return blocking, on_key, excluded


def evaluate_gate(inventory: Inventory, key: str, conflicts: Mapping[str, int] | None = None) -> GateReport:
    """Decide the gate for ``key`` from an inventory (plus CONFLICT counts of the last run, if any)."""
    totals: dict[str, int] = {}
    per_target: dict[str, dict[str, Any]] = {}
    for name, inv in inventory.targets.items():
        if conflicts and conflicts.get(name):
            inv.counts["CONFLICT"] = max(inv.counts["CONFLICT"], conflicts[name])
        blocking, on_key, excluded = target_blocking(inv, key, inventory.current_key)
        for cat, n in blocking.items():
            totals[cat] = totals.get(cat, 0) + n
        entry: dict[str, Any] = {"on_key": on_key, "blocking": {c: n for c, n in blocking.items() if n},
                                 "excluded_on_key": excluded}
        if inv.blocked_reason:
            entry["blocked_reason"] = inv.blocked_reason
        entry.update({k: v for k, v in inv.extra.items() if k.startswith("transit_") or k == "tenants"})
        per_target[name] = entry
    is_open = bool(inventory.targets) and not any(totals.values())
    return GateReport(key=key, open=is_open, blocking=totals, targets=per_target, current_key=inventory.current_key)
