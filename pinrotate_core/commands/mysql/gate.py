"""``gate --retire KEY`` on MySQL / MariaDB (contract §6): one look at one moment of the server.

The look: ``START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY``; inside it the deep inventory
of every configured target with no tenant filter (``.inventory``) and the sweep of every
database the role can read (``.sweep``); the verdict by ``verdict.evaluate_gate`` with the
same categories as on PostgreSQL (CONFLICT from ``pinrotate.conflicts``). Before the look, the
keyring is compared with the key check values runs recorded in ``pinrotate.key_checks`` (other
material under a recorded key id: exit 2). The transactions in flight are read in the snapshot too (after
``INNODB_TRX_CACHE_S``, so that one that had written before the snapshot is listed).

An open verdict is settled before it is given: prepared XA transactions close it (PREPARED); the
transactions in flight at the look are waited for (bounded by ``[gate] wait``) and the look is
taken again, else IN_FLIGHT; commits not flushed at once (``innodb_flush_log_at_trx_commit``,
``sync_binlog``) are waited for their flush interval; a server that is a replica not caught up, or
a primary whose replicas are not each named in ``[database] replicas`` and caught up with the
GTID position after the look (``_replicas``), is
STANDBY_BEHIND. Whatever cannot be checked closes the gate, named. Never a value or a statement text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pymysql
import sqlalchemy as sa

from ...config import Settings, TargetSettings
from ...engines.base.checks import OpenTransaction
from ...engines.base.features import redacted
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql import replication
from ...engines.mysql.connect import MySqlConnection
from ...engines.mysql.gate import GATE_CHECKS, INNODB_TRX_CACHE_S
from ...errors import DatabaseError
from ...gate.discover import apply_discovery
from ...gate.retire import section_entry, slice_of
from ...gate.settle import apply_settled
from ...gate.settle_result import SettleResult, named
from ...gate.verdict import GateReport, check_retire_key, evaluate_gate, held_keys
from ...key_checks import KeyIdentity
from ...keyring import Keyring
from ...log import log_event
from ...reading_start import start_reading
from ...schemes.base import LEGACY_KEY, LegacyMigration
from ...schemes.registry import scheme_class
from .bookkeeping import confirm_key_identity_mysql
from .inventory import inventory_on_mysql, take_mysql_inventory
from .sweep import sweep_mysql

R = TypeVar("R")  # what one look decides: a report, or a run's reports by key

POLL_S = 0.2
LOOKS = 5  # a verdict that keeps finding new transactions in flight is closed after this many looks


def _look(conn: MySqlConnection, settings: Settings, keyring: Keyring, key: str, *, deep: bool,
          erase_excluded: bool, provider: object) -> tuple[GateReport, list[OpenTransaction], list[str]]:
    reports, in_flight, prepared = _look_keys(conn, settings, keyring, [key], deep=deep,
                                              erase_excluded=erase_excluded, provider=provider)
    return reports[key], in_flight, prepared


def _look_keys(conn: MySqlConnection, settings: Settings, keyring: Keyring, keys: Sequence[str], *, deep: bool,
               erase_excluded: bool, provider: object, failed: Mapping[str, int] | None = None,
               conflicts: Mapping[str, int] | None = None) -> tuple[dict[str, GateReport], list[OpenTransaction],
                                                                     list[str]]:
    """One look for every key of ``keys`` (one snapshot, one inventory, one sweep). ``failed``,
    ``conflicts``: a run's own rows that did not decrypt and its CONFLICTs, per target."""
    before = GATE_CHECKS.candidate_tables(conn)  # the catalog is not in the snapshot: what a DROP would hide
    with GATE_CHECKS.snapshot(conn):
        time.sleep(INNODB_TRX_CACHE_S)  # INNODB_TRX is a cache: let it catch up with the snapshot's moment
        in_flight = GATE_CHECKS.in_flight(conn)
        prepared = GATE_CHECKS.prepared(conn)
        inv = inventory_on_mysql(conn, settings, keyring, deep=deep, provider=provider, gate=True)
        for name, n in (failed or {}).items():
            if name in inv.targets:
                inv.targets[name].counts["FAILED"] = max(inv.targets[name].counts["FAILED"], n)
        reports = {key: evaluate_gate(inv, key, conflicts=conflicts, erase_excluded=erase_excluded) for key in keys}
        discovery = sweep_mysql(conn, settings, keyring, key_ids=list(keys), tables_before=before)
        for report in reports.values():
            apply_discovery(report, discovery)
    for report in reports.values():
        report.counts = {name: t.as_dict() for name, t in inv.targets.items()}
    return reports, in_flight, prepared


def _still_open(conn: MySqlConnection, waited: list[OpenTransaction], deadline: float) -> list[OpenTransaction]:
    """Those of ``waited`` still in flight once they ended or ``deadline`` passed."""
    ids = {t.transaction for t in waited}
    while True:
        left = [t for t in GATE_CHECKS.in_flight(conn) if t.transaction in ids]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)


def _replicas(conn: MySqlConnection, settings: Settings, deadline: float) -> SettleResult | None:
    """STANDBY_BEHIND when this server replicates and is not caught up, or serves replicas that have
    not applied what the gate read: each must be named in ``[database] replicas`` (a URL of a server
    that replicates from this one), and each waits for this server's GTID position after the look
    until ``deadline`` (``[gate] wait``). What cannot be checked closes the gate, named."""
    behind = [r for r in GATE_CHECKS.replica_positions(conn) if not r.running or r.lag_s is None or r.lag_s > 0]
    if behind:
        names = [f"{r.name} ({r.problem or 'lag ' + str(r.lag_s)})" for r in behind]
        return SettleResult.closed("STANDBY_BEHIND", len(behind), f"this server is a replica not caught up: "
                                   f"{named(names)}", {"replicas": names})
    attached = replication.binlog_readers(conn)
    if not attached:
        return None
    urls = settings.database.replicas or ()
    if not urls:
        return SettleResult.closed("STANDBY_BEHIND", attached, f"{attached} replica(s) read this server's binary "
                                   "log: name each in [database] replicas so that the gate can check it applied "
                                   "what the gate read", {"replicas_attached": attached})
    position = GATE_CHECKS.primary_position(conn) or ""  # after the look: every commit it saw is in it
    me = replication.server_id(conn)
    registered = replication.attached_replicas(conn) or set()  # None: the server will not say
    ours: set[int] = set()  # the named replicas of this server
    checked: dict[int, str] = {}  # those of them that applied what the gate read
    problems: list[str] = []
    for url in urls:
        shown = redacted(url)
        engine = mysql_connect.make_engine(url, pool_size=1)
        try:
            with mysql_connect.raw_connection(engine) as replica:
                if me not in replication.source_server_ids(replica):
                    problems.append(f"{shown} (does not replicate from this server)")
                    continue
                replica_id = replication.server_id(replica)
                ours.add(replica_id)
                if not replication.wait_for_position(replica, position, deadline - time.monotonic()):
                    problems.append(f"{shown} (has not applied {position} within [gate] wait)")
                    continue
                checked[replica_id] = shown
        except (DatabaseError, pymysql.err.MySQLError) as e:
            problems.append(f"{shown} (cannot be asked: "
                            f"{e if isinstance(e, DatabaseError) else mysql_connect.describe_db_error(e)})")
        finally:
            engine.dispose()
    # Every reader of the binary log counts (a registered replica that no URL names, or a reader that
    # did not register): the larger of the two is what no URL stands for.
    unnamed = max(attached - len(ours), len(registered - ours))
    if unnamed > 0:
        problems.append(f"{unnamed} replica(s) reading this server's binary log that [database] replicas does "
                        "not name")
    if problems:
        unchecked = max(attached - len(checked), len(registered - set(checked)), 1)
        return SettleResult.closed("STANDBY_BEHIND", unchecked, f"replicas not shown caught up: {named(problems)}",
                                   {"replicas": problems, "gtid_position": position})
    return SettleResult(True, facts={"replicas_checked": sorted(checked.values()), "gtid_position": position})


def settle(conn: MySqlConnection, settings: Settings, first: tuple[R, list[OpenTransaction], list[str]],
           look: Callable[[], tuple[R, list[OpenTransaction], list[str]]],
           is_open: Callable[[R], bool]) -> tuple[R, SettleResult]:
    """Wait for what was in flight at the look, look again, until an open verdict holds still.
    ``is_open``: whether the look's verdict (one report, or a run's reports by key) is open."""
    deadline = time.monotonic() + settings.gate.wait
    report, in_flight, prepared = first
    facts: dict[str, Any] = {"engine": "mysql"}
    for _ in range(LOOKS):
        if not is_open(report):
            return report, SettleResult(True, facts=facts)
        if prepared:
            return report, SettleResult.closed("PREPARED", len(prepared), f"prepared XA transactions: "
                                               f"{named(prepared)}", {**facts, "prepared": prepared})
        if not in_flight:
            break
        left = _still_open(conn, in_flight, deadline)
        if left:
            names = [t.describe() for t in left]
            return report, SettleResult.closed("IN_FLIGHT", len(left), "transactions in flight at the gate's read "
                                               f"still open after [gate] wait: {named(names)}",
                                               {**facts, "in_flight": names})
        facts["waited_for"] = facts.get("waited_for", 0) + len(in_flight)
        report, in_flight, prepared = look()  # what they wrote is now in a new moment: read it again
    else:
        return report, SettleResult.closed("IN_FLIGHT", max(len(in_flight), 1), "new transactions kept starting "
                                           "while the gate waited", facts)
    if not is_open(report):
        return report, SettleResult(True, facts=facts)
    durability = GATE_CHECKS.durability(conn)
    facts["durability"] = durability.settings
    if not durability.durable:
        wait = float(durability.settings.get("flush_wait_s", 1))
        facts["flush_waited_s"] = wait
        time.sleep(wait)  # every commit the gate read reaches the disk within this
    replicas = _replicas(conn, settings, deadline)
    if replicas is not None and not replicas.ok:
        return report, SettleResult(False, replicas.reason, replicas.blocking, {**facts, **replicas.facts})
    return report, SettleResult(True, facts={**facts, **(replicas.facts if replicas is not None else {})})


def mysql_retire_gate(settings: Settings, key: str, *, tenant: str | None = None, deep: bool = True,
                      erase_excluded: bool = False) -> GateReport:
    """``gate --retire KEY`` on a MySQL / MariaDB URL (see the module docstring)."""
    start = start_reading(settings, tenant, pool_size=1)
    engine, settings, provider, keyring = start.engine, start.settings, start.provider, start.keyring
    try:
        check_retire_key(keyring, key)
        part = None
        if tenant is not None:
            shown = take_mysql_inventory(engine, settings, keyring, tenant=tenant, provider=provider)
            part = slice_of(evaluate_gate(shown, key), tenant=tenant, targets=None)
        with mysql_connect.raw_connection(engine) as conn:
            # Before the look: a keyring with other material under a recorded key id is refused (exit 2).
            identity: KeyIdentity = confirm_key_identity_mysql(conn, settings, keyring, provider, record=False)

            def look() -> tuple[GateReport, list[OpenTransaction], list[str]]:
                return _look(conn, settings, keyring, key, deep=deep, erase_excluded=erase_excluded,
                             provider=provider)

            report, settled = settle(conn, settings, look(), look, lambda r: r.open)
            if report.open or not settled.ok:
                apply_settled(report, settled)
        report.database = mysql_connect.database_identity(engine)
    finally:
        engine.dispose()
    report.slice = part
    report.keyring_source = keyring.source
    report.key_identity = identity.about(key)
    report.scope = {"all_tenants": True, "targets": [t.name for t in settings.targets], "deep": deep,
                    "filter": {"tenant": tenant}, "erase_excluded": erase_excluded, "one_snapshot": True}
    return report


def run_gate(engine: sa.Engine, settings: Settings, keyring: Keyring, provider: object, *,
             targets: Sequence[TargetSettings], tenant: str | None, failed: Mapping[str, int],
             conflicts: Mapping[str, int], run_id: str) -> dict[str, Any]:
    """A run's gate section on MySQL / MariaDB: every older key decided by the same deep look as
    ``gate --retire`` (one snapshot of the whole server, settled the same way), whatever the run's
    filters; a filtered run's report also carries its slice (never deciding). Fail closed: a look
    that cannot be taken or settled closes the key, saying why. ``failed`` and ``conflicts``: the
    run's own rows that did not decrypt and its CONFLICTs, per target (as ``gate.retire.run_gate``)."""
    keys = [k for k in held_keys(keyring) if k != keyring.current]
    if not any(isinstance(scheme_class(t.format), LegacyMigration) for t in settings.targets):
        keys = [k for k in keys if k != LEGACY_KEY]
    names = [t.name for t in targets]
    filtered = tenant is not None or set(names) != {t.name for t in settings.targets}
    out: dict[str, Any] = {}
    if not keys:
        return out
    try:
        shown = (take_mysql_inventory(engine, settings, keyring, tenant=tenant, provider=provider)
                 if filtered and tenant is not None else None)
        with mysql_connect.raw_connection(engine) as conn:
            def look() -> tuple[dict[str, GateReport], list[OpenTransaction], list[str]]:
                return _look_keys(conn, settings, keyring, keys, deep=True, erase_excluded=False, provider=provider,
                                  failed=failed, conflicts=conflicts)

            verdicts, settled = settle(conn, settings, look(), look,
                                       lambda seen: any(r.open for r in seen.values()))
    except (DatabaseError, pymysql.err.MySQLError) as e:  # fail closed: a look that could not read decides nothing
        reason = str(e) if isinstance(e, DatabaseError) else mysql_connect.describe_db_error(e)
        log_event("gate_sweep_failed", level=40, run_id=run_id, error=reason)
        return {key: {"open": False, "blocking": {}, "reason": f"the gate's look could not be taken: {reason}"}
                for key in keys}
    for key, report in verdicts.items():
        if report.open:  # settled as gate --retire settles; a closed verdict stays as it was found
            apply_settled(report, settled)
            if not settled.ok:
                log_event("gate_not_settled", level=30, run_id=run_id, key=key, blocking=sorted(settled.blocking),
                          reason=settled.reason)
        out[key] = section_entry(report, key, shown=shown, conflicts=conflicts, tenant=tenant,
                                 targets=names if filtered else None)
    return out
