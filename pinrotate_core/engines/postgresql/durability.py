"""Durability of what was read: the retire gate answers "open" only on commits that are on disk.

Batches commit with ``synchronous_commit = off``, so a batch can be visible to another session
before its WAL is flushed, and a crash would put its rows back on the old key. The gate therefore
waits, after its reads, until the WAL is flushed up to the insert position. Nothing here writes a
table; forcing a flush costs one empty synchronous commit.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from ...errors import DatabaseError
from ...log import log_event
from .connect import describe_db_error

FLUSH_WAIT_S = 30.0
_POLL_S = 0.05


def confirm_flushed(conn: psycopg.Connection[Any], *, timeout: float = FLUSH_WAIT_S) -> dict[str, Any]:
    """Return once every commit visible now is flushed; what was compared, for the gate's report.

    Call it AFTER the reads: a commit those reads saw wrote its commit record before it became
    visible, so it lies below the insert position read here (a position read before the reads
    would miss a commit landing between the two). On a standby there is nothing to wait for: a
    standby replays only WAL that it has flushed and that the primary sent after flushing it.
    Raises ``DatabaseError`` (fail closed) when it cannot confirm.
    """
    try:
        row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        if row is not None and row[0]:
            replay = conn.execute("SELECT pg_last_wal_replay_lsn()::text").fetchone()
            return {"standby": True, "wal_replay_lsn": replay[0] if replay else None, "flushed": True}
        row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    except psycopg.Error as e:
        raise DatabaseError(f"cannot read the WAL position ({describe_db_error(e)})") from None
    assert row is not None
    return wait_for_flush(conn, str(row[0]), timeout=timeout)


def insert_position(conn: psycopg.Connection[Any]) -> str | None:
    """The WAL insert position now (everything committed lies below it); None on a standby, which
    writes no WAL of its own."""
    try:
        row = conn.execute("SELECT CASE WHEN pg_is_in_recovery() THEN NULL"
                           " ELSE pg_current_wal_insert_lsn()::text END").fetchone()
    except psycopg.Error as e:
        raise DatabaseError(f"cannot read the WAL position ({describe_db_error(e)})") from None
    return None if row is None or row[0] is None else str(row[0])


def wait_for_flush(conn: psycopg.Connection[Any], target_lsn: str, *, timeout: float = FLUSH_WAIT_S) -> dict[str, Any]:
    """Wait (bounded) until ``pg_current_wal_flush_lsn() >= target_lsn``.

    The WAL writer flushes asynchronous commits within a few ``wal_writer_delay``, but WAL after
    the last commit may wait for the next one; so when the position is not flushed at once, one
    synchronous commit forces it (it flushes everything before its own commit record), then the
    flush position is polled until ``timeout``.
    """
    deadline = time.monotonic() + timeout
    forced = False
    while True:
        try:
            row = conn.execute("SELECT pg_current_wal_flush_lsn()::text, pg_current_wal_flush_lsn() >= %s::pg_lsn",
                               (target_lsn,)).fetchone()
        except psycopg.Error as e:
            raise DatabaseError(f"cannot read the WAL flush position ({describe_db_error(e)})") from None
        assert row is not None
        flush_lsn, flushed = str(row[0]), bool(row[1])
        if flushed:
            return {"wal_insert_lsn": target_lsn, "wal_flush_lsn": flush_lsn, "flushed": True, "forced_flush": forced}
        if not forced:
            forced = True
            try:
                force_flush(conn)
            except psycopg.Error as e:  # e.g. a read-only role: the WAL writer still gets there
                log_event("wal_flush_not_forced", level=30, error=describe_db_error(e))
            continue
        if time.monotonic() >= deadline:
            raise DatabaseError(f"the WAL up to {target_lsn} is not flushed after {timeout:g}s (flushed up to "
                                f"{flush_lsn}): the gate does not answer on commits a crash could undo")
        time.sleep(_POLL_S)


def force_flush(conn: psycopg.Connection[Any]) -> None:
    """One synchronous commit that writes a commit record: the WAL up to it is flushed on return."""
    with conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = on")
        conn.execute("SELECT pg_current_xact_id()")  # an xid, so that the COMMIT writes a record
