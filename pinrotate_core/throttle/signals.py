"""What the throttle reads on the primary, in one statement per look: the WAL position, the standbys
that replay it, busy application sessions, and application sessions waiting for a row that one of
our batches holds. Read-only; knows nothing of limits or waiting.

Sessions of other roles show their state only to superusers and members of pg_read_all_stats
(pg_monitor): grant it to the rotation's role or the counts are too low and replay positions hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

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
