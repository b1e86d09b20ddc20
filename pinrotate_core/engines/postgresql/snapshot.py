"""One moment of the whole database (PostgreSQL): the snapshot every read of a gate look shares.

A look opens ONE ``REPEATABLE READ READ ONLY`` transaction on one connection; the inventory of every
target, the sweep of every other relation, large objects, conflicts and key check values are all read
in it, so a value that an application moves between two tables while the gate reads is seen in one
of them. The transactions writing at that snapshot (its ``txid_current_snapshot()`` xip, and the xids
from its xmax up to the xmax another session sees just after: the newest, which no snapshot lists) are
kept: the settle step waits for them, then looks again, before an open verdict stands.

Relations are followed by identity: each relation the look planned (by oid, from the snapshot's own
catalog) is locked ``ACCESS SHARE`` by its current name (as pg_dump locks what it dumps), then checked to be the same relation with the
same storage as in the snapshot. One renamed after the snapshot is still read (under its new name); one
dropped, rewritten (TRUNCATE, ALTER TABLE ... TYPE, VACUUM FULL) or locked by DDL past ``LOCK_TIMEOUT``
cannot be read as planned: the caller reports it UNREADABLE (closed, named), never "nothing there".

Everything PostgreSQL-specific about that moment lives here, in the PostgreSQL room (the gate, ``gate/look.py``,
``gate/discover.py`` and ``gate/settle.py``, decides over it; MySQL's moment is ``mysql/gate.py``'s snapshot).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, cast

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ...errors import DatabaseError
from .connect import describe_db_error, raw_connection

LOCK_TIMEOUT: Final = "5s"  # a relation locked by DDL longer than this is reported unreadable: closed
POLL_S: Final = 0.1
MAX_NEWEST: Final = 100_000  # xids assigned around the snapshot that a look waits for, at most


@dataclass(frozen=True)
class Moment:
    """The open look: its connection (inside the transaction) and the xids in progress at its snapshot."""

    conn: psycopg.Connection[Any]
    in_progress: tuple[int, ...]


@contextmanager
def one_moment(engine: sa.Engine) -> Iterator[Moment]:
    """A connection inside a REPEATABLE READ READ ONLY transaction whose snapshot is taken at once.

    The transaction ends (rolled back: it wrote nothing) when the block ends; its locks go with it.
    """
    with raw_connection(engine) as conn:
        try:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
            # The first query takes the transaction's snapshot. Its xip are not all the writers in flight
            # then: the newest (xid >= its xmax) are in no snapshot. They hold their xid's lock, so they
            # are read from pg_locks right after; one that ended in between raised the xmax another
            # session sees (latestCompletedXid + 1), and so is in [xmax, that xmax).
            row = conn.execute("SELECT txid_snapshot_xmax(s), ARRAY(SELECT txid_snapshot_xip(s)) "
                               "FROM (SELECT txid_current_snapshot() AS s) AS q").fetchone()
            assert row is not None
            xmax, xip = int(str(row[0])), [int(str(x)) for x in cast("list[Any]", row[1])]
            held = [_xid8(int(str(r[0])), xmax) for r in conn.execute(_XID_LOCKS).fetchall()]
            with raw_connection(engine) as other:
                after = other.execute("SELECT txid_snapshot_xmax(txid_current_snapshot())").fetchone()
            newest = int(str(after[0])) if after is not None else xmax
            if newest - xmax > MAX_NEWEST:
                raise DatabaseError(f"{newest - xmax} transactions ended while the gate took its snapshot: "
                                    "too many to wait for; run the gate again")
            xids = sorted(set(xip) | {x for x in held if x >= xmax or x in xip} | set(range(xmax, newest)))
            rows = conn.execute(_THIS_DATABASE, (xids,)).fetchall() if xids else []
        except psycopg.Error as e:
            raise DatabaseError(f"cannot open the gate's snapshot ({describe_db_error(e)})") from None
        try:
            yield Moment(conn, tuple(int(str(r[0])) for r in rows))
        finally:
            if not conn.closed:
                try:
                    conn.execute("ROLLBACK")
                except psycopg.Error:
                    pass  # a broken connection: the pool invalidates it


# The snapshot's xip are the whole cluster's: a writer in ANOTHER database (known by its xid lock's holder)
# writes no row here and is not waited for. One whose holder cannot be told is kept (fail closed).
_THIS_DATABASE = """
SELECT x FROM unnest(%s::bigint[]) AS x
 WHERE txid_status(x) IS DISTINCT FROM 'aborted'
   AND NOT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                    WHERE l.locktype = 'transactionid' AND l.transactionid::text::bigint = x %% 4294967296
                      AND a.datid IS NOT NULL
                      AND a.datid <> (SELECT oid FROM pg_database WHERE datname = current_database()))
"""

# The xid of every transaction that has one and runs now (its own xid lock), unless it is known to run in
# another database (pg_stat_activity is read once per transaction: a session it does not list is kept).
_XID_LOCKS = """
SELECT l.transactionid::text::bigint FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted
   AND (a.datid IS NULL OR a.datid = (SELECT oid FROM pg_database WHERE datname = current_database()))
"""


def _xid8(xid: int, near: int) -> int:
    """A 32-bit xid as the 64-bit one (with epoch) closest to ``near``."""
    full = (near & ~0xFFFFFFFF) | xid
    if full > near + (1 << 31):
        full -= 1 << 32
    elif full < near - (1 << 31):
        full += 1 << 32
    return full


_SNAPSHOT_REL = """
SELECT n.nspname::text, c.relname::text, c.relfilenode::bigint
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s
"""
# regclass output and pg_relation_filenode read the catalog as it is NOW (not the snapshot's).
# A relation that no longer exists prints as its bare number (a name of digits only is printed quoted).
_CURRENT_REL = "SELECT %s::oid::regclass::text, pg_relation_filenode(%s::oid)::bigint"


def hold(conn: psycopg.Connection[Any], oid: int, label: str) -> str | None:
    """Lock relation ``oid`` (ACCESS SHARE, for the rest of the look) and check it is the one the snapshot
    planned; None when it can be read as planned, else a one-line reason (the relation is UNREADABLE).

    Must run inside ``one_moment``: the lock lasts until the look ends, so no rename, drop or rewrite can
    happen while it reads. A failure is confined to a savepoint: the look goes on with the others.
    """
    try:
        with conn.transaction():
            planned = conn.execute(_SNAPSHOT_REL, (oid,)).fetchone()
            if planned is None:
                return f"{label} is not in the gate's snapshot"
            for _ in range(3):  # a rename between the name's look-up and the lock: look it up again
                current = conn.execute(_CURRENT_REL, (oid, oid)).fetchone()
                if current is None or str(current[0]).isdigit():
                    return f"{label} was dropped while the gate read it: run the gate again"
                # regclass output is quoted by the server (quote_ident): usable as SQL as it is. A read of no
                # row takes ACCESS SHARE until the look ends (LOCK TABLE refuses materialized views).
                conn.execute(sql.SQL("SELECT FROM {} LIMIT 0").format(sql.SQL(str(current[0]))))
                after = conn.execute(_CURRENT_REL, (oid, oid)).fetchone()
                if after is not None and after[0] == current[0]:
                    break
            else:
                return f"{label} was renamed again and again while the gate read it: run the gate again"
            if planned[2] != 0 and after[1] != planned[2]:
                return (f"{label} was rewritten (TRUNCATE, ALTER TABLE, VACUUM FULL or CLUSTER) after the gate's "
                        "snapshot: its rows as of that moment cannot be read; run the gate again")
    except psycopg.errors.LockNotAvailable as e:
        return f"cannot read {label} ({describe_db_error(e)}): locked by DDL past {LOCK_TIMEOUT}; run the gate again"
    except psycopg.errors.InsufficientPrivilege as e:
        return f"cannot read {label} ({describe_db_error(e)}): grant SELECT or list it in [gate] discover_skip"
    except psycopg.errors.UndefinedTable:
        return f"{label} was dropped or renamed while the gate read it: run the gate again"
    return None


def current_name(conn: psycopg.Connection[Any], oid: int) -> sql.Composable:
    """The relation's name now (after ``hold``: stable until the look ends), as SQL."""
    row = conn.execute("SELECT %s::oid::regclass::text", (oid,)).fetchone()
    assert row is not None
    return sql.SQL(str(row[0]))


def still_in_progress(conn: psycopg.Connection[Any], xids: tuple[int, ...]) -> list[int]:
    """The xids of ``xids`` whose transaction has not ended yet (``txid_status``)."""
    if not xids:
        return []
    try:
        rows = conn.execute("SELECT x FROM unnest(%s::bigint[]) AS x WHERE txid_status(x) = 'in progress'",
                            (list(xids),)).fetchall()
    except psycopg.Error as e:
        raise DatabaseError(f"cannot read the status of the transactions in flight ({describe_db_error(e)})") from None
    return [int(r[0]) for r in rows]


def wait_for_xids(conn: psycopg.Connection[Any], xids: tuple[int, ...], *, wait: float) -> list[int]:
    """Wait (at most ``wait`` seconds) until every transaction of ``xids`` has ended; the ones still open."""
    started = time.monotonic()
    still = still_in_progress(conn, xids)
    while still and time.monotonic() - started < wait:
        time.sleep(POLL_S)
        still = still_in_progress(conn, tuple(still))
    return still


def hold_target(conn: psycopg.Connection[Any], relation: sql.Composable, label: str) -> str | None:
    """``hold`` a configured target's table and every partition / child read through it, by the name the
    configuration gives; the table must have had that name in the snapshot too. None: read as planned."""
    regname = relation.as_string(conn)
    row = conn.execute("SELECT to_regclass(%s)::oid", (regname,)).fetchone()
    if row is None or row[0] is None:
        return None  # missing now: resolving the target reports it BLOCKED
    oid = int(row[0])
    # The snapshot's name of that oid (pg_class read in the snapshot) against its name now (the syscache).
    named = conn.execute("SELECT format('%%I.%%I', n.nspname, c.relname) = "
                         "(pg_identify_object('pg_class'::regclass, c.oid, 0)).identity FROM pg_class c "
                         "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s", (oid,)).fetchone()
    if named is None or not named[0]:
        return f"table {label} is not the one it was at the gate's snapshot (renamed or created meanwhile): run the gate again"
    reason = hold(conn, oid, label)
    if reason is not None:
        return reason
    # The snapshot's partitions and children: each must still be the one the snapshot knew.
    for (child,) in conn.execute("WITH RECURSIVE d(oid) AS (SELECT inhrelid FROM pg_inherits WHERE inhparent = %s "
                                 "UNION SELECT i.inhrelid FROM pg_inherits i JOIN d ON i.inhparent = d.oid) "
                                 "SELECT oid FROM d", (oid,)).fetchall():
        reason = hold(conn, int(child), f"{label} (partition or child {int(child)})")
        if reason is not None:
            return reason
    return None
