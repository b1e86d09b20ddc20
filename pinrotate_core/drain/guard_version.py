"""The row-version write guard (aesgcm, vault-transit): a batch is read without row locks and each
row is written only where it is still the version read (its ``xmin`` and, on a plain table, its
``ctid``: compare-and-swap on the row version). No row is locked while its batch is re-encrypted;
an application's edit in between is never overwritten: the write misses that row, which is left as
the application wrote it (and read again by the sweep while it is still stale).

The write first waits at most ``row_wait`` seconds for a row an application holds locked (rows are
locked only from that statement to COMMIT). Past that, the pipeline rolls the batch back and
writes it again cautiously: its rows are locked ``FOR NO KEY UPDATE SKIP LOCKED`` first (never
waited on) and only those are written; the others are left for the sweep after the pass.

Row versions travel in binary as PostgreSQL sends them: read as bytes, sent back as one array each.
It owns its statements; it never runs a batch itself.
"""

from __future__ import annotations

import operator
import struct
from typing import Any, Protocol, runtime_checkable

import psycopg
import sqlalchemy as sa
from psycopg import postgres, sql
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.types.string import ByteaBinaryLoader

from ..db import raw_connection
from ..schemes.base import Scheme, Write
from ..targets import ROW_VERSION_COLUMNS, Column
from .counting import BacklogCounter
from .guards import Sweep
from .options import DrainOptions
from .results import BatchOutcome, DrainResult, Tally
from .selection import Selection

# Seconds the first try of a write waits for a row an application holds locked, before the batch
# is written again skipping such rows. The rows already written by that statement stay locked
# while it waits, so this is short (of the order of the adaptive batch time); never above
# lock_timeout (the pipeline takes the smaller).
ROW_WAIT = 0.05


@runtime_checkable
class KeyVersioned(Protocol):
    """A scheme whose rows carry a key-version column, set to the current version by every write."""

    def key_version_column(self) -> Column | None: ...


class Tids(list[bytes]):
    """Row ``ctid`` values as PostgreSQL sends them in binary (6 bytes each), to be sent back."""


class Xids(list[bytes]):
    """Row ``xmin`` values as PostgreSQL sends them in binary (4 bytes each), to be sent back."""


class _PackedArrayDumper(Dumper):
    """A one-dimensional binary array of fixed-size binary values, built in one join (no Python
    call per element: these travel once per row)."""

    format = Format.BINARY
    element_oid = 0
    element_size = 0

    def dump(self, obj: Any) -> bytes:
        if not obj:
            return _HEAD.pack(0, 0, self.element_oid)
        size = _INT.pack(self.element_size)
        if sum(map(len, obj)) != len(obj) * self.element_size:  # never from PostgreSQL; never sent malformed
            raise ValueError(f"a row version of the wrong size for oid {self.element_oid}")
        return _HEAD.pack(1, 0, self.element_oid) + _DIM.pack(len(obj), 1) + size + size.join(obj)


class _TidsDumper(_PackedArrayDumper):
    oid = postgres.types["tid"].array_oid
    element_oid = postgres.types["tid"].oid
    element_size = 6


class _XidsDumper(_PackedArrayDumper):
    oid = postgres.types["xid"].array_oid
    element_oid = postgres.types["xid"].oid
    element_size = 4


_HEAD = struct.Struct("!iiI")  # dimensions, has-nulls flag, element type
_DIM = struct.Struct("!ii")  # length, lower bound
_INT = struct.Struct("!i")


def version_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """A binary cursor that reads ``tid`` and ``xid`` as the bytes PostgreSQL sends and sends
    ``Tids`` and ``Xids`` back as arrays of them (this cursor only: the connection's other users
    read them as usual)."""
    cur = conn.cursor(binary=True)
    cur.adapters.register_loader("tid", ByteaBinaryLoader)
    cur.adapters.register_loader("xid", ByteaBinaryLoader)
    cur.adapters.register_dumper(Tids, _TidsDumper)
    cur.adapters.register_dumper(Xids, _XidsDumper)
    return cur


class VersionGuard:
    row_wait: float | None = ROW_WAIT

    def __init__(self, scheme: Scheme, selection: Selection, dry_run: bool) -> None:
        self.scheme = scheme
        self.selection = selection
        self.target = scheme.target
        self.by_ctid = self.target.by_ctid
        # A dry run writes nothing: it reads no row versions. Joined on the id, the ctid is not used.
        versions = [] if dry_run else [v for v in ROW_VERSION_COLUMNS if self.by_ctid or v != "ctid"]
        self._versions = len(versions)
        self._extra = [sql.Identifier(v) for v in versions]
        self._statements: dict[tuple[int, ...], sql.Composed] = {}
        s = self.selection
        self._lock = sql.SQL("SELECT {id} FROM {rel} WHERE {id} = ANY(%b::{t}[]) FOR NO KEY UPDATE SKIP LOCKED").format(
            id=s.id, rel=self.target.relation, t=sql.Identifier(self.target.id_column.type_name))
        self._ours = sql.SQL("SELECT {id} FROM {rel} WHERE {id} = ANY(%b::{t}[]) AND xmin = pg_current_xact_id()::xid").format(
            id=s.id, rel=self.target.relation, t=sql.Identifier(self.target.id_column.type_name))

    def read(self, conn: psycopg.Connection[Any], lo: Any, hi: Any, size: int) -> list[tuple[Any, ...]]:
        query, params = self.selection.next_batch(lo, hi, size, extra=self._extra)
        return version_cursor(conn).execute(query, params).fetchall()

    def received(self, rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], Any]:
        """(the rows as the scheme reads them, their ids and versions in the same order)."""
        n = self._versions
        if not n:
            return rows, None
        # Three columns of the rows, not a transposition of all of them (this runs for every batch).
        versions = tuple(list(map(operator.itemgetter(i), rows)) for i in (0, *range(-n, 0)))
        return [r[:-n] for r in rows], versions

    @staticmethod
    def _versions_of(ids: list[Any], versions: tuple[list[Any], ...]) -> list[list[Any]]:
        """The versions of ``ids``, in their order: the rows read, unless the plan left some out
        (FAILED rows, a cautious write's skipped rows)."""
        read_ids, *kept = versions
        if len(ids) == len(read_ids) and all(map(operator.is_, ids, read_ids)):
            return kept
        position = {row_id: i for i, row_id in enumerate(read_ids)}
        at = [position[row_id] for row_id in ids]
        return [[column[i] for i in at] for column in kept]

    def write(self, conn: psycopg.Connection[Any], write: Write, outcome: BatchOutcome, versions: Any,
              cautious: bool) -> None:
        ids, new, weights = write.ids, write.new, write.weights
        if cautious:  # lock what is free, skip what an application holds: never wait on a row
            cur = conn.cursor(binary=True)
            free = {r[0] for r in cur.execute(self._lock, [ids]).fetchall()}
            if len(free) < len(ids):
                keep = [i for i, row_id in enumerate(ids) if row_id in free]
                outcome.skipped_locked += len(ids) - len(keep)
                ids = [ids[i] for i in keep]
                new = [[column[i] for i in keep] for column in new]
                weights = [weights[i] for i in keep]
                if not ids:
                    return
        held = self._versions_of(ids, versions)
        params: list[Any] = [ids, *([Tids(held[0]), Xids(held[1])] if self.by_ctid else [Xids(held[0])])]
        cur = version_cursor(conn)
        cur.execute(self._update(write), [*params, *new])
        if cur.rowcount == len(ids):
            outcome.reencrypted += sum(weights)
            return
        # Some rows changed since they were read: they keep the application's version. Which rows
        # this transaction wrote is read back (rare: only when a write missed).
        ours = {r[0] for r in conn.cursor(binary=True).execute(self._ours, [ids]).fetchall()}
        outcome.reencrypted += sum(w for row_id, w in zip(ids, weights) if row_id in ours)
        outcome.changed += len(ids) - len(ours)

    def _update(self, write: Write) -> sql.Composed:
        """One set-based statement for a write, joined on the row version read; arrays are cast to
        base types (``varchar``, never ``varchar(n)``), so a value too long for its column is an
        error that rolls the batch back, never a silent truncation."""
        cached = self._statements.get(write.columns)
        if cached is not None:
            return cached
        columns = [self.target.columns[j] for j in write.columns]
        arrays: list[sql.Composable] = [sql.SQL("%b::{}[]").format(sql.Identifier(self.target.id_column.type_name))]
        keys: list[sql.Composable] = [sql.Identifier("pinrotate_id")]
        match: list[sql.Composable] = [sql.SQL("t.{} = u.pinrotate_id").format(self.selection.id)]
        if self.by_ctid:
            arrays.append(sql.SQL("%b::tid[]"))
            keys.append(sql.Identifier("pinrotate_ctid"))
            # Found by its ctid alone (one heap fetch). The id is still checked: a table rewritten
            # since the read (CLUSTER, VACUUM FULL) keeps each row's xmin but not its ctid, so
            # (ctid, xmin) may then be another row inserted by the same transaction. It is checked
            # with IS NOT DISTINCT FROM (the same as = for a primary key), which the planner never
            # turns into a second probe of the primary key.
            match = [sql.SQL("t.ctid = u.pinrotate_ctid"),
                     sql.SQL("t.{} IS NOT DISTINCT FROM u.pinrotate_id").format(self.selection.id)]
        arrays.append(sql.SQL("%b::xid[]"))
        keys.append(sql.Identifier("pinrotate_xmin"))
        match.append(sql.SQL("t.xmin = u.pinrotate_xmin"))
        arrays += [sql.SQL("%b::{}[]").format(sql.Identifier(c.type_name)) for c in columns]
        names = [sql.Identifier(f"n{i}") for i in range(len(columns))]
        sets = [sql.SQL("{} = u.{}").format(sql.Identifier(c.name), n) for c, n in zip(columns, names)]
        kv = self.scheme.key_version_column() if isinstance(self.scheme, KeyVersioned) else None
        if kv is not None:
            sets.append(sql.SQL("{} = {}").format(sql.Identifier(kv.name), sql.Literal(int(self.scheme.current_key))))
        # The row version read, still stale and in scope: anything else is someone else's newer row.
        statement = sql.SQL(
            "UPDATE {rel} AS t SET {sets} FROM unnest({arrays}) AS u({keys}, {names}) "
            "WHERE {match} AND {guard}"
        ).format(rel=self.target.relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
                 keys=sql.SQL(", ").join(keys), names=sql.SQL(", ").join(names),
                 match=sql.SQL(" AND ").join(match), guard=self.selection.where_t)
        self._statements[write.columns] = statement
        return statement

    def next_sweep(self, engine: sa.Engine, counter: BacklogCounter, tally: Tally) -> Sweep:
        """Sweep the whole range again while rows are left that did not fail: rows an application
        held locked, or changed and left stale, since they were read."""
        with raw_connection(engine) as conn:
            left, unfailed = counter.count_left(conn, tally.failed_ids())
        return Sweep(due=unfailed > 0, backlog=left)

    def record_conflicts(self, conn: psycopg.Connection[Any] | None, result: DrainResult,
                         options: DrainOptions) -> None:
        """A row version that changed is the application's, kept: there is never a CONFLICT to record."""
