"""Where the verdict is taken: ``gate --retire KEY`` and the gate section of a run's report.

Both read a fresh inventory and decide through ``verdict.evaluate_gate``; an open verdict is given
only once what was read is durable (``durability.confirm_flushed``). The run never computes a
verdict of its own: it calls ``run_gate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from ..config import Settings, TargetSettings
from ..db import database_identity, database_url, make_engine, raw_connection
from ..durability import confirm_flushed
from ..errors import DatabaseError
from ..inventory import take_inventory
from ..key_checks import confirm_key_identity
from ..keyring import Keyring
from ..log import log_event
from ..providers import KeyProvider, build_provider
from ..schemes.base import LEGACY_KEY
from ..scope import check_tenant_scope
from .verdict import GateReport, check_retire_key, evaluate_gate, held_keys


def retire_gate(settings: Settings, key: str, *, tenant: str | None = None, deep: bool = True) -> GateReport:
    """``gate --retire KEY``: a fresh inventory (deep by default: every value decrypted) and the verdict,
    with what the change-ticket record names: database identity, keyring source, counts, scope.

    A KEY the keyring does not hold, or the current key, is refused before the database is read
    (``KeyNotRetirable``, exit 2). An open verdict is given only once the WAL behind every commit
    the inventory saw is flushed (``durability.confirm_flushed``).
    """
    check_tenant_scope(settings.targets, tenant)
    provider = build_provider(settings)
    keyring = provider.load_keyring()
    check_retire_key(keyring, key)
    engine = make_engine(database_url(settings), pool_size=2)
    try:
        # A keyring whose key of some id is not the one recorded for it is refused (exit 2); a gate only compares.
        identity = confirm_key_identity(engine, settings, keyring, provider, record=False)
        inv = take_inventory(engine, settings, keyring, deep=deep, tenant=tenant, provider=provider)
        report = evaluate_gate(inv, key)
        if report.open:
            with raw_connection(engine) as conn:
                report.durability = confirm_flushed(conn)
        report.database = database_identity(engine)
    finally:
        engine.dispose()
    report.keyring_source = keyring.source
    report.key_identity = identity.about(key)
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
    inv = take_inventory(engine, settings, keyring, targets=targets, tenant=tenant, provider=provider)
    for name, n in failed.items():
        if name in inv.targets:
            # Rows that did not decrypt; fpc1 values on a missing key are UNKNOWN_KEY in the inventory.
            inv.targets[name].counts["FAILED"] = n
    # Every key `gate --retire` would answer about (Transit: every older version it still decrypts);
    # legacy only for fpc1 targets.
    keys = [k for k in held_keys(keyring) if k != keyring.current]
    if not any(t.format == "fpc1" for t in targets):
        keys = [k for k in keys if k != LEGACY_KEY]
    verdicts = {key: evaluate_gate(inv, key, conflicts=conflicts) for key in keys}
    durable = True
    if any(v.open for v in verdicts.values()):
        try:
            with raw_connection(engine) as conn:
                confirm_flushed(conn)
        except DatabaseError as e:
            # Fail closed: no key is reported free on commits that a crash could still undo.
            log_event("gate_not_durable", level=40, run_id=run_id, error=str(e))
            durable = False
    return {key: {"open": report.open and durable, "blocking": {c: n for c, n in report.blocking.items() if n}}
            for key, report in verdicts.items()}
