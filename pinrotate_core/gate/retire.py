"""Where the verdict is taken: ``gate --retire KEY`` and the gate section of a run's report.

Both read a fresh inventory and decide through ``verdict.evaluate_gate``; an open verdict is given
only once it is settled (``settle``): no transaction from before the read is still in flight or
prepared, and what was read is flushed by the primary and every standby. The run never computes a
verdict of its own: it calls ``run_gate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from ..config import Settings, TargetSettings
from ..db import database_identity, database_url, make_engine
from ..errors import DatabaseError
from ..inventory import Inventory, take_inventory
from ..keyring import Keyring
from ..log import log_event
from ..providers import KeyProvider, build_provider
from ..schemes.base import LEGACY_KEY
from ..scope import check_tenant_scope
from .settle import apply_settled, mark_before_reads, settle_open_verdict
from .settle_result import SettleResult
from .verdict import GateReport, check_retire_key, evaluate_gate, held_keys


def retire_gate(settings: Settings, key: str, *, tenant: str | None = None, deep: bool = True) -> GateReport:
    """``gate --retire KEY``: a fresh inventory (deep by default: every value decrypted) and the verdict,
    with what the change-ticket record names: database identity, keyring source, counts, scope.

    A KEY the keyring does not hold, or the current key, is refused before the database is read
    (``KeyNotRetirable``, exit 2). An open verdict is given only once it is settled
    (``settle.settle_open_verdict``; what was waited for is in ``report.durability``).
    """
    check_tenant_scope(settings.targets, tenant)
    provider = build_provider(settings)
    keyring = provider.load_keyring()
    check_retire_key(keyring, key)
    engine = make_engine(database_url(settings), pool_size=2)
    try:
        mark = mark_before_reads(engine)  # settle: what is in flight before the reads begin

        def look() -> tuple[Inventory, GateReport]:
            inv = take_inventory(engine, settings, keyring, deep=deep, tenant=tenant, provider=provider)
            return inv, evaluate_gate(inv, key)

        inv, report = look()
        if report.open:  # settle: wait for transactions in flight and standbys, look again if it waited
            (inv, report), settled = settle_open_verdict(engine, settings, mark, (inv, report), look,
                                                         lambda seen: seen[1].open)
            apply_settled(report, settled)
        report.database = database_identity(engine)
    finally:
        engine.dispose()
    report.keyring_source = keyring.source
    report.counts = {name: t.as_dict() for name, t in inv.targets.items()}
    report.scope = {"tenant": tenant, "all_tenants": tenant is None, "deep": deep,
                    "targets": [t.name for t in settings.targets]}
    return report


def run_gate(engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
             targets: Sequence[TargetSettings], tenant: str | None, failed: Mapping[str, int],
             conflicts: Mapping[str, int], run_id: str) -> dict[str, Any]:
    """The gate for every older key of the keyring, from a fresh (shallow) inventory, after a run.

    ``failed``: the rows each target's drain could not decrypt; ``conflicts``: its CONFLICTs.
    """
    # Every key `gate --retire` would answer about (Transit: every older version it still decrypts);
    # legacy only for fpc1 targets.
    keys = [k for k in held_keys(keyring) if k != keyring.current]
    if not any(t.format == "fpc1" for t in targets):
        keys = [k for k in keys if k != LEGACY_KEY]

    def look() -> dict[str, GateReport]:
        inv = take_inventory(engine, settings, keyring, targets=targets, tenant=tenant, provider=provider)
        for name, n in failed.items():
            if name in inv.targets:
                # Rows that did not decrypt; fpc1 values on a missing key are UNKNOWN_KEY in the inventory.
                inv.targets[name].counts["FAILED"] = n
        return {key: evaluate_gate(inv, key, conflicts=conflicts) for key in keys}

    mark = mark_before_reads(engine)  # settle: what is in flight before the reads begin
    verdicts = look()
    if any(v.open for v in verdicts.values()):  # settle, as retire_gate does
        try:
            verdicts, settled = settle_open_verdict(engine, settings, mark, verdicts, look,
                                                    lambda seen: any(v.open for v in seen.values()))
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
    return {key: {"open": report.open, "blocking": {c: n for c, n in report.blocking.items() if n},
                  **({"reason": report.durability["reason"]} if report.durability.get("reason") else {})}
            for key, report in verdicts.items()}
