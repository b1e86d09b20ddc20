"""The retire gate: may KEY be destroyed now (crypto-shredding)?

The verdict is whole (contract §6): the keyring is shared by every target and tenant, so it is
taken over an inventory of every configured target with no tenant filter; a filter only shows a
slice, which never decides. Open only when nothing is on KEY (``vault-transit``: on any version
<= KEY, since retiring a Transit version retires every older one), nothing could be hiding there
(UNKNOWN + UNKNOWN_KEY + BLOCKED + FAILED + CONFLICT = 0), and no EXCLUDED row (soft-deleted,
``require_not_null`` unset, outside every tenant) still references KEY, unless the operator
acknowledged erasing them (``erase_excluded``). Values on other old keys do not block KEY
(``aesgcm``, ``fpc1``). A KEY the keyring does not hold, or the current key, is never asked about:
it is refused before anything is read (``check_retire_key``).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..inventory import Inventory, TargetInventory
from ..keyring import Keyring, sort_key
from ..schemes.base import LEGACY_KEY, OrderedKeys
from ..schemes.registry import scheme_class

ALWAYS_BLOCKING = ("UNKNOWN", "UNKNOWN_KEY", "BLOCKED", "FAILED", "CONFLICT")


@dataclass
class GateReport:
    key: str
    open: bool
    blocking: dict[str, int]
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    current_key: str = ""
    # --erase-excluded: EXCLUDED rows on KEY did not block; destroying KEY erases them.
    erase_excluded: bool = False
    # What a filter (--tenant, a run's --target/--tenant) shows: counts only, never the verdict.
    slice: dict[str, Any] | None = None
    # Filled by gate.retire.retire_gate for the change-ticket record (gate_record): where the verdict
    # was taken, on which keyring, over which scope. Names and counts only.
    database: dict[str, Any] = field(default_factory=dict)
    keyring_source: str = ""
    counts: dict[str, dict[str, Any]] = field(default_factory=dict)
    scope: dict[str, Any] = field(default_factory=dict)
    # How the gate made sure that what it read is on disk (see durability.confirm_flushed).
    durability: dict[str, Any] = field(default_factory=dict)
    # The sweep outside the configured targets (gate.discover.apply_discovery): names and counts only.
    discovery: dict[str, Any] = field(default_factory=dict)
    # Whether KEY's check value was recorded in pinrotate.key_checks (when, by whom; never the value).
    key_identity: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        tenants = sorted({tn for t in self.targets.values() for tn in t.get("tenants", [])})
        out = {"key": self.key, "open": self.open, "blocking": self.blocking, "targets": self.targets,
               "current_key": self.current_key, "tenants": tenants, "application_version": application_version(),
               "verdict_over": "every configured target and tenant",
               "erase_excluded": self.erase_excluded, "excluded_on_key": self.excluded_on_key()}
        if self.slice is not None:
            out["slice"] = self.slice
        if self.durability:
            out["durability"] = self.durability
        if self.discovery:
            out["discovery"] = self.discovery
        if self.key_identity:
            out["key_identity"] = self.key_identity
        return out

    def excluded_on_key(self) -> dict[str, dict[str, int]]:
        """EXCLUDED values still on KEY, per target and scope rule (what destroying KEY erases)."""
        return {name: dict(t["excluded_by_rule"]) for name, t in self.targets.items() if t.get("excluded_by_rule")}


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


def key_order(format_name: str) -> OrderedKeys | None:
    """The key order of a format's scheme, when its keys are ordered versions (asked by name: the
    verdict works from inventory counts, not from bound schemes)."""
    scheme = scheme_class(format_name)
    return scheme if isinstance(scheme, OrderedKeys) else None


def on_key_category(key: str, current: str, order: OrderedKeys | None = None) -> str:
    """The inventory category of values that sit on ``key`` when ``current`` is current."""
    if key == LEGACY_KEY:
        return "LEGACY"
    if key == current:
        return "ACTIVE"
    if order is not None and order.newer_than(key, current):
        return "NEWER"
    return "HISTORICAL"


def retired_with(inv: TargetInventory, key: str) -> Callable[[str], bool]:
    """Which keys of a target's counts go when KEY is destroyed: KEY itself, and whatever else its
    scheme says (``vault-transit``: every older version Transit still decrypts)."""
    order = key_order(inv.format)
    return order.retired_with(key, inv.extra) if order is not None else (lambda k: k == key)


def target_blocking(inv: TargetInventory, key: str, current: str, *,
                    erase_excluded: bool = False) -> dict[str, Any]:
    """One target's part of the verdict: what blocks KEY there, the values on KEY, and the EXCLUDED
    values on KEY per scope rule (they block unless ``erase_excluded``)."""
    blocking = {c: inv.counts[c] for c in ALWAYS_BLOCKING}
    retired = retired_with(inv, key)
    if key == LEGACY_KEY:
        on_key = {LEGACY_KEY: inv.counts["LEGACY"]}
    else:
        on_key = {k: n for k, n in inv.by_key.items() if retired(k)}
    order = key_order(inv.format)
    for k, n in on_key.items():
        category = on_key_category(k, current, order)
        blocking[category] = blocking.get(category, 0) + n
    by_rule = {rule: n for rule, keys in sorted(inv.excluded_by_rule.items())
               if (n := sum(c for k, c in keys.items() if retired(k)))}
    excluded = sum(by_rule.values())
    blocking["EXCLUDED"] = 0 if erase_excluded else excluded
    entry: dict[str, Any] = {"on_key": sum(on_key.values()), "blocking": {c: n for c, n in blocking.items() if n},
                             "excluded_on_key": excluded, "excluded_by_rule": by_rule}
    if len(on_key) > 1:  # destroying KEY retires older versions too (vault-transit)
        entry["on_versions"] = {k: n for k, n in sorted(on_key.items(), key=lambda kv: sort_key(kv[0])) if n}
    return entry


def evaluate_gate(inventory: Inventory, key: str, conflicts: Mapping[str, int] | None = None, *,
                  erase_excluded: bool = False) -> GateReport:
    """Decide the gate for ``key`` from an inventory (plus CONFLICT counts of the last run, if any).

    The inventory must cover every configured target with no tenant filter for the verdict to mean
    anything (``gate.retire`` takes it so); over a filtered one it only describes a slice.
    """
    totals: dict[str, int] = {}
    per_target: dict[str, dict[str, Any]] = {}
    for name, inv in inventory.targets.items():
        if conflicts and conflicts.get(name):
            inv.counts["CONFLICT"] = max(inv.counts["CONFLICT"], conflicts[name])
        entry = target_blocking(inv, key, inventory.current_key, erase_excluded=erase_excluded)
        for cat, n in entry["blocking"].items():
            totals[cat] = totals.get(cat, 0) + n
        if inv.blocked_reason:
            entry["blocked_reason"] = inv.blocked_reason
        entry.update(inv.extra)  # the scheme's inventory facts (vault-transit: its versions), tenants
        per_target[name] = entry
    for cat in (*ALWAYS_BLOCKING, "EXCLUDED"):
        totals.setdefault(cat, 0)
    is_open = bool(inventory.targets) and not any(totals.values())
    return GateReport(key=key, open=is_open, blocking=totals, targets=per_target, current_key=inventory.current_key,
                      erase_excluded=erase_excluded)
