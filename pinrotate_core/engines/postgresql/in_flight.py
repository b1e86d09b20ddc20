"""Transactions in flight and prepared in this database (PostgreSQL), as the retire gate reads them:
the sessions in a transaction when the gate marks its read (``pg_stat_activity``), whether they are
still in that same transaction, and the prepared transactions (``pg_prepared_xacts``). Pids,
``application_name``s, roles and durations only, never a query text. The rules over them (what
closes the gate, how long to wait) stay with the gate (``gate/settle.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from ...errors import DatabaseError
from .connect import describe_db_error

# Processes that run in the database but never write rows of a target: autovacuum, walsenders
# (logical decoding holds a transaction for as long as it streams), and parallel workers (their
# leader's transaction is the one waited for).
EXEMPT_BACKENDS = frozenset({"autovacuum worker", "autovacuum launcher", "walsender", "parallel worker"})
# What lets a role see other roles' sessions in pg_stat_activity.
STATS_PRIVILEGE = "pg_read_all_stats (or pg_monitor)"


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
    xids: tuple[int, ...] = ()  # in progress at the look's snapshot (snapshot.py one_moment): waited for too


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


def still_open(conn: psycopg.Connection[Any], sessions: list[Session]) -> list[Session]:
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
