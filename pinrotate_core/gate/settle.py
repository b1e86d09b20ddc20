"""Settling an open verdict: no transaction from before the gate's read can still write, none is
prepared, and what the gate read is flushed by the primary and by every physical standby.

The gate marks the transactions in progress BEFORE its reads (``mark_read_start``, in the PostgreSQL
room's ``in_flight``); when the counts
would open, ``settle_open_verdict`` waits (bounded by ``[gate] wait``) until each has ended, looks
again when it had to wait, then waits for the flush (``standbys``). Never a query text: pids,
``application_name``s, roles and durations only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa

from ..config import Settings
from ..engines.postgresql.connect import raw_connection
from ..engines.postgresql.durability import confirm_flushed
from ..engines.postgresql.in_flight import (
    STATS_PRIVILEGE,
    ReadMark,
    mark_read_start,
    prepared_transactions,
    still_open,
)
from ..engines.postgresql.snapshot import wait_for_xids
from ..log import log_event
from .settle_result import SettleResult, named
from .standbys import settle_standbys
from .verdict import GateReport

POLL_S = 0.1

Look = TypeVar("Look")


def _closed_prepared(gids: list[str], facts: dict[str, Any]) -> SettleResult:
    reason = (f"{len(gids)} prepared transaction(s) in this database: gid {named([repr(g) for g in gids])};"
              " COMMIT PREPARED or ROLLBACK PREPARED them first")
    return SettleResult.closed("PREPARED", len(gids), reason, {**facts, "prepared": gids})


def settle_in_flight(conn: psycopg.Connection[Any], mark: ReadMark, *, wait: float) -> SettleResult:
    """Wait (at most ``wait`` seconds) until every transaction of ``mark`` has ended; closed (fail
    closed) when one has not, when one cannot be seen, or when a transaction is prepared."""
    facts: dict[str, Any] = {"wait_limit_s": wait, "in_flight": {"waited_for": len(mark.in_flight),
                             "sessions": [s.as_dict() for s in mark.in_flight[:20]]}}
    if mark.standby:
        return SettleResult.closed("IN_FLIGHT", 1, "the gate reads a standby (pg_is_in_recovery() is true): the"
                                   " primary's transactions in flight are not visible there; set [database] url"
                                   " to the primary", facts)
    if mark.hidden:
        return SettleResult.closed(
            "IN_FLIGHT", len(mark.hidden),
            f"{len(mark.hidden)} session(s) of other roles in this database are not visible to role {mark.role}"
            f" ({named([s.describe() for s in mark.hidden])}): whether they are in a transaction is unknown;"
            f" grant {STATS_PRIVILEGE} to {mark.role}", facts)
    if mark.untracked:
        return SettleResult.closed(
            "IN_FLIGHT", len(mark.untracked),
            f"track_activities is off for {named([s.describe() for s in mark.untracked])}: its transactions"
            " are not visible", facts)
    gids = prepared_transactions(conn)
    if gids:
        return _closed_prepared(gids, facts)
    started = time.monotonic()
    still = list(mark.in_flight)
    if still:
        log_event("gate_waiting_for_transactions", sessions=len(still), pids=[s.pid for s in still[:20]],
                  wait_limit_s=wait)
    while still:
        still = still_open(conn, still)
        if not still:
            break
        if time.monotonic() - started >= wait:
            facts["in_flight"]["still_open"] = [s.as_dict() for s in still[:20]]
            return SettleResult.closed(
                "IN_FLIGHT", len(still),
                f"{len(still)} transaction(s) in flight since before the gate read did not end within {wait:g}s:"
                f" {named([s.describe() for s in still])}", facts)
        time.sleep(POLL_S)
    open_xids = wait_for_xids(conn, mark.xids, wait=max(0.0, wait - (time.monotonic() - started)))
    if open_xids:
        facts["in_flight"]["still_open_xids"] = open_xids[:20]
        return SettleResult.closed(
            "IN_FLIGHT", len(open_xids),
            f"{len(open_xids)} transaction(s) writing when the gate took its snapshot did not end within {wait:g}s:"
            f" xid {named([str(x) for x in open_xids])}", facts)
    facts["in_flight"]["waited_s"] = round(time.monotonic() - started, 3)
    gids = prepared_transactions(conn)  # prepared while the gate waited
    if gids:
        return _closed_prepared(gids, facts)
    return SettleResult(True, facts=facts)


def mark_before_reads(engine: sa.Engine) -> ReadMark:
    """``mark_read_start`` on a connection of the gate's pool (its own sessions are then idle)."""
    with raw_connection(engine) as conn:
        return mark_read_start(conn)


def settle_open_verdict(engine: sa.Engine, settings: Settings, mark: ReadMark, first: Look,
                        look: Callable[[], Look], is_open: Callable[[Look], bool]) -> tuple[Look, SettleResult]:
    """Settle a first look whose counts would open the gate; the look the verdict stands on, and why.

    ``look`` reads the inventory again: it is asked only when the gate had to wait for a
    transaction (without one, the first look already saw every commit from before the mark).
    Raises ``DatabaseError`` when the primary cannot be read or its WAL cannot be confirmed flushed.
    """
    wait = settings.gate.wait
    with raw_connection(engine) as conn:
        result = settle_in_flight(conn, mark, wait=wait)
    if not result.ok:
        return first, result
    final = first
    if mark.in_flight or mark.xids:
        final = look()
        result.facts["in_flight"]["second_look"] = True
        if not is_open(final):
            return final, result
    with raw_connection(engine) as conn:
        flushed = confirm_flushed(conn)
        result.facts.update(flushed)
        if not flushed.get("wal_insert_lsn"):  # read on a standby (the mark closes that case first)
            return final, SettleResult.closed("STANDBY_BEHIND", 1, "no WAL position to compare standbys with",
                                              result.facts)
        standbys = settle_standbys(conn, settings.database.replicas, str(flushed["wal_insert_lsn"]), wait=wait)
    result.facts["standbys"] = standbys.facts
    if not standbys.ok:
        return final, SettleResult.closed(next(iter(standbys.blocking)), sum(standbys.blocking.values()),
                                          standbys.reason or "standbys not flushed", result.facts)
    return final, result


def apply_settled(report: GateReport, result: SettleResult) -> None:
    """Put what the gate waited for in ``report.durability``; a result that is not ok closes the gate."""
    report.durability = result.facts
    if not result.ok:
        report.open = False
        for category, n in result.blocking.items():
            report.blocking[category] = report.blocking.get(category, 0) + n
