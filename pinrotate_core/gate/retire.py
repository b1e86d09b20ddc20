"""Where the verdict is taken: ``gate --retire KEY`` and the gate section of a run's report.

Both read a fresh inventory of EVERY configured target with no tenant filter and decide through
``verdict.evaluate_gate``: the keyring is shared by every tenant and target, so a filter (``--tenant``,
a run's ``--target``/``--tenant``) only adds a slice to the report, labelled as not deciding. An
open verdict is given only once what was read is durable (``durability.confirm_flushed``). The run
never computes a verdict of its own: it calls ``run_gate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from ..config import Settings, TargetSettings
from ..db import database_identity, database_url, make_engine, raw_connection
from ..durability import confirm_flushed
from ..errors import DatabaseError
from ..inventory import Inventory, take_inventory
from ..keyring import Keyring
from ..log import log_event
from ..providers import KeyProvider, build_provider
from ..schemes.base import LEGACY_KEY
from ..scope import check_tenant_scope
from .discover import apply_discovery, discover_outside_targets, outside_targets, sweep_for_run
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
    """``gate --retire KEY``: a fresh inventory of every configured target and tenant (deep by default:
    every value decrypted) and the verdict, with what the change-ticket record names: database
    identity, keyring source, counts, scope. ``tenant`` adds that tenant's slice (shallow counts),
    which never decides. ``erase_excluded``: EXCLUDED rows on KEY do not block; the report says
    how many, per target and rule, destroying KEY erases.

    A KEY the keyring does not hold, or the current key, is refused before the database is read
    (``KeyNotRetirable``, exit 2). An open verdict is given only once the WAL behind every commit
    the inventory saw is flushed (``durability.confirm_flushed``).
    """
    check_tenant_scope(settings.targets, tenant)
    provider = build_provider(settings)
    keyring = provider.load_keyring()
    check_retire_key(keyring, key)
    engine = make_engine(database_url(settings), pool_size=2)
    part = None
    try:
        if tenant is not None:
            shown = take_inventory(engine, settings, keyring, tenant=tenant, provider=provider)
            part = slice_of(evaluate_gate(shown, key), tenant=tenant, targets=None)
        inv = take_inventory(engine, settings, keyring, deep=deep, provider=provider)
        report = evaluate_gate(inv, key, erase_excluded=erase_excluded)
        # Values under KEY outside the configured targets, and tables the sweep cannot read (gate.discover).
        apply_discovery(report, discover_outside_targets(engine, settings, keyring))
        if report.open:
            with raw_connection(engine) as conn:
                report.durability = confirm_flushed(conn)
        report.database = database_identity(engine)
    finally:
        engine.dispose()
    report.slice = part
    report.keyring_source = keyring.source
    report.counts = {name: t.as_dict() for name, t in inv.targets.items()}
    report.scope = {"all_tenants": True, "targets": [t.name for t in settings.targets], "deep": deep,
                    "filter": {"tenant": tenant}, "erase_excluded": erase_excluded}
    return report


def run_gate(engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
             targets: Sequence[TargetSettings], tenant: str | None, failed: Mapping[str, int],
             conflicts: Mapping[str, int], run_id: str) -> dict[str, Any]:
    """The gate for every older key of the keyring after a run, from a fresh (shallow) inventory of
    every configured target and tenant, whatever the run's filters (``targets``, ``tenant``); a
    filtered run's report also carries its slice per key (``"slice"``, never deciding).

    ``failed``: the rows each drained target could not decrypt; ``conflicts``: its CONFLICTs. A
    target the run did not drain counts what the inventory and ``pinrotate.conflicts`` say.
    """
    inv = _with_failed(take_inventory(engine, settings, keyring, provider=provider), failed)
    # Every key `gate --retire` would answer about (Transit: every older version it still decrypts);
    # legacy only when some configured target is fpc1.
    keys = [k for k in held_keys(keyring) if k != keyring.current]
    if not any(t.format == "fpc1" for t in settings.targets):
        keys = [k for k in keys if k != LEGACY_KEY]
    verdicts = {key: evaluate_gate(inv, key, conflicts=conflicts) for key in keys}
    sweep_for_run(engine, settings, keyring, verdicts, run_id)  # outside the targets (gate.discover)
    names = [t.name for t in targets]
    filtered = tenant is not None or set(names) != {t.name for t in settings.targets}
    shown: Inventory | None = None
    if filtered and tenant is not None:
        shown = _with_failed(take_inventory(engine, settings, keyring, tenant=tenant, targets=targets,
                                            provider=provider), failed)
    durable = True
    if any(v.open for v in verdicts.values()):
        try:
            with raw_connection(engine) as conn:
                confirm_flushed(conn)
        except DatabaseError as e:
            # Fail closed: no key is reported free on commits that a crash could still undo.
            log_event("gate_not_durable", level=40, run_id=run_id, error=str(e))
            durable = False
    out: dict[str, Any] = {}
    for key, report in verdicts.items():
        entry: dict[str, Any] = {"open": report.open and durable,
                                 "blocking": {c: n for c, n in report.blocking.items() if n},
                                 **outside_targets(report)}
        if filtered:
            entry["slice"] = slice_of(report if shown is None else evaluate_gate(shown, key, conflicts=conflicts),
                                      tenant=tenant, targets=names)
        out[key] = entry
    return out


def _with_failed(inv: Inventory, failed: Mapping[str, int]) -> Inventory:
    """A shallow inventory plus the rows each drained target could not decrypt (fpc1 values on a
    missing key are UNKNOWN_KEY in the inventory already)."""
    for name, n in failed.items():
        if name in inv.targets:
            inv.targets[name].counts["FAILED"] = max(inv.targets[name].counts["FAILED"], n)
    return inv
