"""What the throttle reads on the primary, in one statement per look: the WAL position, the standbys
that replay it, busy application sessions, and application sessions waiting for a row that one of
our batches holds; what it reads on a configured replica (``replay_position``); and the
single-instance advisory lock. Read-only except the lock; knows nothing of limits or waiting.
``THROTTLE_SIGNALS`` and ``ADVISORY_LOCK`` answer them as ``base.checks`` asks (``room.ROOM``).

Sessions of other roles show their state only to superusers and members of pg_read_all_stats
(pg_monitor): grant it to the rotation's role or the counts are too low and replay positions hidden.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ...errors import DatabaseError
from ..base.checks import LoadSample, ReplicaPosition
from .connect import describe_db_error

APPLICATION_NAME = "pinrotate"  # how our own backends are told apart (db.make_engine sets it)

_WAL_LSN = sql.SQL("pg_current_wal_lsn()::text")

# Standbys that replay: a logical walsender (pg_recvlogical, a subscription) streams through a
# logical slot, and pg_receivewal reports where it wrote but never a replay position; neither
# replays, so neither can fall behind. A logical walsender is also told by its database (a physical
# one has none), which it has from its start, before its slot is marked active (as gate/standbys.py
# tells them). A row whose details are hidden (no pg_monitor) stays in.
_STANDBYS = sql.SQL(
    "(SELECT coalesce(json_agg(json_build_object("
    " 'name', coalesce(nullif(r.application_name, ''), 'walreceiver') || '@' ||"
    " coalesce(host(r.client_addr), 'local') || ':' || r.pid,"
    " 'replay_lsn', r.replay_lsn::text, 'visible', r.state IS NOT NULL) ORDER BY r.pid), '[]')"
    " FROM pg_stat_replication r"
    " WHERE NOT (r.write_lsn IS NOT NULL AND r.replay_lsn IS NULL)"
    " AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical')"
    " AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.pid AND a.datid IS NOT NULL))")

_BUSY = sql.SQL(
    "(SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND backend_type = 'client backend'"
    " AND pid <> pg_backend_pid() AND application_name IS DISTINCT FROM %(app)s)")

# Only row-lock waits count: a session waiting for a row (a tuple lock, or the transaction that
# locked the row) of a drained table, blocked by one of our backends, is waiting for a batch. Any
# other lock of ours (the single-instance advisory lock, bookkeeping) is not the batch size's doing.
# pg_blocking_pids is asked only about such sessions (it takes the lock manager's partition locks);
# MATERIALIZED keeps the planner from calling it on every session.
_BLOCKED = sql.SQL(
    "(WITH waiting AS MATERIALIZED ("
    " SELECT a.pid FROM pg_stat_activity a"
    " WHERE a.wait_event_type = 'Lock' AND a.wait_event IN ('tuple', 'transactionid')"
    " AND a.pid <> pg_backend_pid() AND a.application_name IS DISTINCT FROM %(app)s"
    " AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'tuple'{tables}))"
    " SELECT count(*) FROM waiting w WHERE EXISTS ("
    " SELECT 1 FROM pg_stat_activity holder WHERE holder.pid = ANY(pg_blocking_pids(w.pid))"
    " AND holder.application_name = %(app)s))")
_ON_TABLES = sql.SQL(" AND l.relation = ANY(ARRAY(SELECT to_regclass(t)::oid FROM unnest(%(tables)s::text[]) t))")


@dataclass(frozen=True)
class Signals:
    """One look at the primary; None where it was not asked for."""

    wal_lsn: str | None = None
    standbys: list[dict[str, Any]] | None = None  # name, replay_lsn (None: unknown), visible
    busy: int | None = None
    blocked: int | None = None


def read_signals(conn: psycopg.Connection[Any], *, wal: bool = False, standbys: bool = False, busy: bool = False,
                 blocked: bool = False, tables: Sequence[str] = (),
                 application_name: str = APPLICATION_NAME) -> Signals:
    """The signals asked for, in one statement. ``tables``: the drained tables (``table`` or
    ``schema.table``, as configured); empty: a row-lock wait on any table counts."""
    blocked_sql = _BLOCKED.format(tables=_ON_TABLES if tables else sql.SQL(""))
    parts = [_WAL_LSN if wal else None, _STANDBYS if standbys else None, _BUSY if busy else None,
             blocked_sql if blocked else None]
    query = sql.SQL("SELECT {}").format(sql.SQL(", ").join(p if p is not None else sql.NULL for p in parts))
    params = {"app": application_name, "tables": [sql.Identifier(*t.split(".")).as_string(conn) for t in tables]}
    row = conn.execute(query, params if busy or blocked else None).fetchone()
    assert row is not None  # a SELECT without FROM returns one row
    lsn, found, busy_count, blocked_count = row
    return Signals(wal_lsn=lsn, standbys=found, busy=None if busy_count is None else int(busy_count),
                   blocked=None if blocked_count is None else int(blocked_count))


def busy_sessions(conn: psycopg.Connection[Any], application_name: str = APPLICATION_NAME) -> int:
    """Client sessions running a statement now, over the whole server, ours left out."""
    return read_signals(conn, busy=True, application_name=application_name).busy or 0


def sessions_blocked_by_us(conn: psycopg.Connection[Any], application_name: str = APPLICATION_NAME,
                           tables: Sequence[str] = ()) -> int:
    """Other sessions waiting for a row of ``tables`` that one of our backends holds locked."""
    return read_signals(conn, blocked=True, tables=tables, application_name=application_name).blocked or 0


def replay_position(conn: psycopg.Connection[Any]) -> str | None:
    """On a configured replica: the WAL position it has replayed; None when it is no streaming
    replica (``pg_is_in_recovery()`` false) or has replayed nothing yet."""
    row = conn.execute("SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text").fetchone()
    if not row or not row[0] or row[1] is None:
        return None
    return str(row[1])


class PostgresThrottleSignals:
    def load(self, conn: psycopg.Connection[Any]) -> LoadSample:
        """Client sessions busy in a statement now, ours (``APPLICATION_NAME``) left out, the
        reading session counted (as MySQL's ``Threads_running`` counts it)."""
        try:
            busy = busy_sessions(conn)
        except psycopg.Error as e:
            raise DatabaseError(f"cannot read the busy sessions ({describe_db_error(e)})") from None
        return LoadSample(busy + 1, {"own_sessions_left_out": True})

    def replica_lag(self, conn: psycopg.Connection[Any]) -> list[ReplicaPosition]:
        """The replaying standbys the primary shows, each with the position it has replayed. Their lag
        in seconds is not a view's answer here (``throttle/replicas.ReplicaLagMeter`` measures it
        against the primary's WAL over time): None, never 0."""
        try:
            standbys = read_signals(conn, standbys=True).standbys or []
        except psycopg.Error as e:
            raise DatabaseError(f"cannot read the standbys ({describe_db_error(e)})") from None
        out = []
        for s in standbys:
            lsn = s["replay_lsn"]
            problem = None if lsn is not None else ("replay position hidden from this role (grant pg_monitor to it)"
                                                    if not s["visible"] else "has not reported a replay position yet")
            out.append(ReplicaPosition(str(s["name"]), None, None if lsn is None else str(lsn), lsn is not None, problem))
        return out


class PostgresAdvisoryLock:
    @contextlib.contextmanager
    def held(self, conn: psycopg.Connection[Any], name: str) -> Iterator[bool]:
        """``pg_try_advisory_lock`` on the name's 64-bit hash: True while this session holds it, False
        at once when another session does. Per database, released when the block ends or the session
        does; ``conn`` must stay open for as long as the lock is meant to be held."""
        try:
            row = conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (name,)).fetchone()
        except psycopg.Error as e:
            raise DatabaseError(f"cannot take the single-instance lock ({describe_db_error(e)})") from None
        got = bool(row and row[0])
        try:
            yield got
        finally:
            if got:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (name,))


THROTTLE_SIGNALS = PostgresThrottleSignals()
ADVISORY_LOCK = PostgresAdvisoryLock()
