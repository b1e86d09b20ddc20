"""Settling an open verdict: no transaction from before the gate's read can still write, none is
prepared, and what the gate read is flushed by the primary and by every physical standby.

The gate marks the transactions in progress BEFORE its reads (``mark_read_start``); when the counts
would open, ``settle_open_verdict`` waits (bounded by ``[gate] wait``) until each has ended, looks
again when it had to wait, then waits for the flush (``standbys``). Never a query text: pids,
``application_name``s, roles and durations only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa

from ..config import Settings
from ..db import describe_db_error, raw_connection
from ..durability import confirm_flushed
from ..errors import DatabaseError
from ..log import log_event
from .settle_result import SettleResult, named
from .snapshot import wait_for_xids
from .standbys import settle_standbys
from .verdict import GateReport

# Processes that run in the database but never write rows of a target: autovacuum, walsenders
# (logical decoding holds a transaction for as long as it streams), and parallel workers (their
# leader's transaction is the one waited for).
EXEMPT_BACKENDS = frozenset({"autovacuum worker", "autovacuum launcher", "walsender", "parallel worker"})
STATS_PRIVILEGE = "pg_read_all_stats (or pg_monitor)"
POLL_S = 0.1

Look = TypeVar("Look")


@dataclass(frozen=True)
class Session:
    """A session of the database that was in a transaction when the gate marked its read."""

    pid: int
    backend_start: datetime | None
    xact_start: datetime | None
    application_name: str
    state: str | None
    role: str | None
    open_s: float

    def describe(self) -> str:
        open_for = f", open {self.open_s:.0f}s" if self.xact_start is not None else ""
        return (f"pid {self.pid} (application_name {self.application_name!r}, role {self.role!r}, "
                f"{self.state or 'state not visible'}{open_for})")

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "application_name": self.application_name, "role": self.role,
                "state": self.state, "open_s": round(self.open_s, 3)}


@dataclass(frozen=True)
class ReadMark:
    """What was in flight in this database just before the gate's reads began (its own session left out)."""

    pid: int
    role: str
    in_flight: tuple[Session, ...]
    hidden: tuple[Session, ...] = ()  # other roles' sessions whose state this role may not see
    untracked: tuple[Session, ...] = ()  # track_activities = off: xact_start is not reported
    standby: bool = False  # the gate reads a standby: the primary's transactions are not visible
    xids: tuple[int, ...] = ()  # in progress at the look's snapshot (snapshot.one_moment): waited for too


_MARK_SQL = """
SELECT a.pid, a.backend_start, a.xact_start, coalesce(a.application_name, ''), a.state, a.usename,
       a.backend_type, a.usesysid IS NULL,
       -- Other roles' sessions show pid, role and application_name only, without pg_read_all_stats.
       a.backend_type IS NULL OR a.query = '<insufficient privilege>',
       coalesce(extract(epoch FROM clock_timestamp() - a.xact_start), 0)::float8
  FROM pg_stat_activity a
 WHERE a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND a.pid <> pg_backend_pid()
 ORDER BY a.xact_start NULLS LAST, a.pid
"""


def mark_read_start(conn: psycopg.Connection[Any]) -> ReadMark:
    """Call BEFORE the reads: the transactions in progress now, with or without an xid yet.

    A transaction that started before this mark may take its xid (and write) only after the reads;
    it is known here by its ``xact_start``, and it has ended once that session's ``xact_start`` is
    another one. A transaction that starts after the mark is not the gate's to see: retire a key
    only once no application writes under it (every instance has the new keyring).
    """
    try:
        # One transaction: behind a transaction pooler both statements reach the same server
        # connection, and the mark leaves out that one transaction, its own (pg_backend_pid()
        # inside it), never a pid remembered from another.
        with conn.transaction():
            row = conn.execute("SELECT pg_backend_pid(), current_user, pg_is_in_recovery()").fetchone()
            rows = conn.execute(_MARK_SQL).fetchall()
    except psycopg.Error as e:
        raise DatabaseError(f"cannot read the sessions in flight ({describe_db_error(e)})") from None
    assert row is not None
    in_flight, hidden, untracked = [], [], []
    for pid, backend_start, xact_start, app, state, role, backend_type, roleless, not_visible, open_s in rows:
        session = Session(int(pid), backend_start, xact_start, str(app), state, role, float(open_s))
        if not_visible:
            if not roleless:  # role-less processes (autovacuum workers) write no rows
                hidden.append(session)
        elif backend_type in EXEMPT_BACKENDS:
            continue
        elif state == "disabled":
            untracked.append(session)
        elif xact_start is not None:
            in_flight.append(session)
    return ReadMark(int(row[0]), str(row[1]), tuple(in_flight), tuple(hidden), tuple(untracked), bool(row[2]))


def prepared_transactions(conn: psycopg.Connection[Any]) -> list[str]:
    """gids of the prepared transactions of this database (readable by every role)."""
    try:
        rows = conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                            " ORDER BY prepared, gid").fetchall()
    except psycopg.Error as e:
        raise DatabaseError(f"cannot read pg_prepared_xacts ({describe_db_error(e)})") from None
    return [str(r[0])[:200] for r in rows]


def _closed_prepared(gids: list[str], facts: dict[str, Any]) -> SettleResult:
    reason = (f"{len(gids)} prepared transaction(s) in this database: gid {named([repr(g) for g in gids])};"
              " COMMIT PREPARED or ROLLBACK PREPARED them first")
    return SettleResult.closed("PREPARED", len(gids), reason, {**facts, "prepared": gids})


def _still_open(conn: psycopg.Connection[Any], sessions: list[Session]) -> list[Session]:
    try:
        rows = conn.execute("SELECT pid, backend_start, xact_start,"
                            " coalesce(extract(epoch FROM clock_timestamp() - xact_start), 0)::float8, state"
                            " FROM pg_stat_activity WHERE pid = ANY(%s)", ([s.pid for s in sessions],)).fetchall()
    except psycopg.Error as e:
        raise DatabaseError(f"cannot read the sessions in flight ({describe_db_error(e)})") from None
    now = {(int(r[0]), r[1], r[2]): (float(r[3]), r[4]) for r in rows}
    still = []
    for s in sessions:
        # The same session (pid and start), still in the same transaction: not ended yet.
        current = now.get((s.pid, s.backend_start, s.xact_start))
        if current is not None:
            still.append(Session(s.pid, s.backend_start, s.xact_start, s.application_name, current[1], s.role,
                                 current[0]))
    return still


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
        still = _still_open(conn, still)
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
