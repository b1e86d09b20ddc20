"""Where the verdict is taken: ``gate --retire KEY`` and the gate section of a run's report.

Both take one look at one moment of the whole database (``look``: one snapshot for the deep inventory of
EVERY configured target with no tenant filter and the sweep outside them) and decide through
``verdict.evaluate_gate`` with the same categories: the keyring is shared by every tenant and target, so
a filter (``--tenant``, a run's ``--target``/``--tenant``) only adds a slice to the report, labelled as
not deciding. An open verdict is
given only once it is settled (``settle``): no transaction from before the read is still in flight
or prepared, and what was read is flushed by the primary and every standby. The run never computes
a verdict of its own: it calls ``run_gate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import psycopg
import sqlalchemy as sa

from ..config import Settings, TargetSettings
from ..engines.postgresql.connect import database_identity
from ..errors import DatabaseError
from ..inventory import Inventory, take_inventory
from ..key_checks import KeyIdentity, confirm_key_identity
from ..keyring import Keyring
from ..log import log_event
from ..providers import KeyProvider
from ..reading_start import start_reading
from ..schemes.base import LEGACY_KEY, LegacyMigration
from ..schemes.registry import scheme_class
from .discover import Discovery, apply_discovery, outside_targets
from .look import look_once, not_swept
from .settle import apply_settled, mark_before_reads, settle_open_verdict
from .settle_result import SettleResult
from .verdict import GateReport, check_retire_key, evaluate_gate, held_keys

SLICE_NOTE = "counts of the filter given only; the verdict is over every configured target and tenant"


def slice_of(report: GateReport, *, tenant: str | None, targets: Sequence[str] | None) -> dict[str, Any]:
    """What a filter shows of KEY: per target, the values on KEY and what blocks in that slice.
    Never an "open": a slice cannot answer for the shared keyring."""
    return {"decides": False, "note": SLICE_NOTE, "tenant": tenant,
            "targets": {name: {k: t[k] for k in ("on_key", "excluded_on_key", "blocking")}
                        for name, t in report.targets.items() if targets is None or name in targets}}


def retire_gate(settings: Settings, key: str, *, tenant: str | None = None, deep: bool = True,
                erase_excluded: bool = False) -> GateReport:
    """``gate --retire KEY``: one look at one moment of the whole database (``look.look_once``: the key
    check values, the inventory of every configured target and tenant, deep by default, and the sweep
    outside them, all in one snapshot), and the verdict, with what the change-ticket record names:
    database identity, keyring source, counts, scope. ``tenant`` adds that tenant's slice (shallow
    counts), which never decides. ``erase_excluded``: EXCLUDED rows on KEY do not block; the report says
    how many, per target and rule, destroying KEY erases.

    A KEY the keyring does not hold, or the current key, is refused before the database is read
    (``KeyNotRetirable``, exit 2); so is a keyring whose key of some id is not the one recorded for it.
    An open verdict is given only once it is settled (``settle.settle_open_verdict``: the transactions
    in flight at the mark and at the snapshot have ended, then a second look at one new moment; what
    was waited for is in ``report.durability``).
    """
    start = start_reading(settings, tenant, pool_size=2)  # a low-code config added since is inside the gate
    engine, settings, provider, keyring = start.engine, start.settings, start.provider, start.keyring
    try:
        check_retire_key(keyring, key)
    except BaseException:
        engine.dispose()
        raise
    part = None
    identity: list[KeyIdentity] = []
    try:
        mark = mark_before_reads(engine)  # settle: what is in flight before the snapshot is taken

        def check_keys(conn: psycopg.Connection[Any]) -> None:
            if not identity:  # a gate only compares; a mismatch refuses (exit 2)
                identity.append(confirm_key_identity(None, settings, keyring, provider, record=False, on=conn))

        def look() -> tuple[Inventory, GateReport]:
            seen = look_once(engine, settings, keyring, provider, deep=deep, key_ids=[key], first=check_keys)
            report = evaluate_gate(seen.inventory, key, erase_excluded=erase_excluded)
            # Values under KEY outside the configured targets, and what the sweep cannot read or search.
            apply_discovery(report, seen.discovery or Discovery(keyring.server_side))
            xids.extend(x for x in seen.in_progress if x not in xids)
            return seen.inventory, report

        xids: list[int] = []
        if tenant is not None:
            shown = take_inventory(engine, settings, keyring, tenant=tenant, provider=provider)
            part = slice_of(evaluate_gate(shown, key), tenant=tenant, targets=None)
        inv, report = look()
        if report.open:  # settle: wait for transactions in flight and standbys, look again if it waited
            mark = replace(mark, xids=tuple(xids))
            (inv, report), settled = settle_open_verdict(engine, settings, mark, (inv, report), look,
                                                         lambda seen: seen[1].open)
            apply_settled(report, settled)
        report.database = database_identity(engine)
    finally:
        engine.dispose()
    report.slice = part
    report.keyring_source = keyring.source
    report.key_identity = identity[0].about(key) if identity else {}
    report.counts = {name: t.as_dict() for name, t in inv.targets.items()}
    report.scope = {"all_tenants": True, "targets": [t.name for t in settings.targets], "deep": deep,
                    "filter": {"tenant": tenant}, "erase_excluded": erase_excluded, "one_snapshot": True}
    return report


def section_entry(report: GateReport, key: str, *, shown: Inventory | None, conflicts: Mapping[str, int],
                  tenant: str | None, targets: Sequence[str] | None) -> dict[str, Any]:
    """One key's entry in a run's gate section, on every engine: its verdict, what blocks it, what
    lies outside the targets, why durability closed it; with a filter (``targets`` not None), the
    slice the run's filter shows (``shown``: the tenant's own inventory, else the verdict's)."""
    entry: dict[str, Any] = {"open": report.open, "blocking": {c: n for c, n in report.blocking.items() if n},
                             **outside_targets(report)}
    if report.durability.get("reason"):
        entry["reason"] = report.durability["reason"]
    if targets is not None:
        entry["slice"] = slice_of(report if shown is None else evaluate_gate(shown, key, conflicts=conflicts),
                                  tenant=tenant, targets=targets)
    return entry


def run_gate(engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
             targets: Sequence[TargetSettings], tenant: str | None, failed: Mapping[str, int],
             conflicts: Mapping[str, int], run_id: str) -> dict[str, Any]:
    """The gate for every older key of the keyring after a run, decided exactly as ``retire_gate``
    decides (contract §6): one look at one moment (deep inventory of every configured target and tenant,
    and the sweep outside them with every older key), whatever the run's filters (``targets``,
    ``tenant``); a filtered run's report also carries its slice per key (``"slice"``, never deciding).
    Settled as ``retire_gate`` settles. Never more open than ``gate --retire``.

    ``failed``: the rows each drained target could not decrypt; ``conflicts``: its CONFLICTs. A
    target the run did not drain counts what the inventory and ``pinrotate.conflicts`` say.
    """
    # Every key `gate --retire` would answer about (Transit: every older version it still decrypts);
    # legacy only when some configured target's scheme migrates legacy values (fpc1).
    keys = [k for k in held_keys(keyring) if k != keyring.current]
    if not any(isinstance(scheme_class(t.format), LegacyMigration) for t in settings.targets):
        keys = [k for k in keys if k != LEGACY_KEY]
    xids: list[int] = []

    def look() -> dict[str, GateReport]:
        def would_open(inv: Inventory) -> bool:  # the sweep can only close: read it when some key is open
            return any(evaluate_gate(inv, key, conflicts=conflicts).open for key in keys)

        try:
            seen = look_once(engine, settings, keyring, provider, deep=True, key_ids=keys, sweep_if=would_open)
        except DatabaseError as e:  # fail closed: a look that could not read decides nothing
            log_event("gate_sweep_failed", level=40, run_id=run_id, error=str(e))
            inv = Inventory(keyring.current, {}, deep=True)
            return {key: _closed_by(evaluate_gate(inv, key), not_swept(e)) for key in keys}
        inv = _with_failed(seen.inventory, failed)
        xids.extend(x for x in seen.in_progress if x not in xids)
        verdicts = {key: evaluate_gate(inv, key, conflicts=conflicts) for key in keys}
        if seen.discovery is not None:
            for report in verdicts.values():
                apply_discovery(report, seen.discovery)
        return verdicts

    mark = mark_before_reads(engine)  # settle: what is in flight before the snapshot is taken
    verdicts = look()
    if any(v.open for v in verdicts.values()):  # settle, as retire_gate does
        try:
            verdicts, settled = settle_open_verdict(engine, settings, replace(mark, xids=tuple(xids)), verdicts,
                                                    look, lambda seen: any(v.open for v in seen.values()))
        except DatabaseError as e:
            # Fail closed: no key is reported free on commits that a crash could still undo.
            log_event("gate_not_durable", level=40, run_id=run_id, error=str(e))
            settled = SettleResult(False, f"not settled: {e}", facts={"reason": f"not settled: {e}"})
        for report in verdicts.values():
            if report.open:
                apply_settled(report, settled)
                if not settled.ok:
                    log_event("gate_not_settled", level=30, run_id=run_id, key=report.key,
                              blocking=sorted(settled.blocking), reason=settled.reason)
    names = [t.name for t in targets]
    filtered = tenant is not None or set(names) != {t.name for t in settings.targets}
    shown: Inventory | None = None
    if filtered and tenant is not None:
        shown = _with_failed(take_inventory(engine, settings, keyring, tenant=tenant, targets=targets,
                                            provider=provider), failed)
    out: dict[str, Any] = {}
    for key, report in verdicts.items():
        out[key] = section_entry(report, key, shown=shown, conflicts=conflicts, tenant=tenant,
                                 targets=names if filtered else None)
    return out


def _closed_by(report: GateReport, discovery: Discovery) -> GateReport:
    apply_discovery(report, discovery)
    report.open = False
    return report


def _with_failed(inv: Inventory, failed: Mapping[str, int]) -> Inventory:
    """A shallow inventory plus the rows each drained target could not decrypt (fpc1 values on a
    missing key are UNKNOWN_KEY in the inventory already)."""
    for name, n in failed.items():
        if name in inv.targets:
            inv.targets[name].counts["FAILED"] = max(inv.targets[name].counts["FAILED"], n)
    return inv
