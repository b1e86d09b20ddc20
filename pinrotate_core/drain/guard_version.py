"""The row-version write guard (aesgcm, vault-transit): a batch is read without row locks and each
row is written only where it is still the version read (compare-and-swap on the row version: its
``ctid`` and ``xmin``, and on a partitioned or inherited table its ``tableoid`` and that table's
file). No row is locked while its batch is re-encrypted; an application's edit in between is never
overwritten: the write misses that row, which is left as the application wrote it (and read again
by the sweep while it is still stale). A row is identified by its table and row version and by its
position in the batch, never by its id alone: an inheritance child's ids may repeat its parent's.

Every write returns what the database stored (trigger effects included), compared in the server
with what was sent; a row that differs is rolled back with its batch (``NotStored``) and the batch
written again without it.

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
from ..errors import DatabaseError
from ..schemes.base import Scheme, Write
from ..targets import Column, row_lock, row_version_columns
from .counting import BacklogCounter
from .guards import Sweep, stored_as_sent
from .options import DrainOptions
from .results import BatchOutcome, DrainResult, NotStored, Tally
from .selection import Position, Selection

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


class Oids(list[bytes]):
    """``oid`` values (a row's ``tableoid``, its table's file) as PostgreSQL sends them in binary (4 bytes each)."""


class Oid(bytes):
    """One ``oid`` as PostgreSQL sends it in binary (4 bytes), to be sent back."""


class Tid(bytes):
    """One ``tid`` as PostgreSQL sends it in binary (6 bytes), to be sent back."""


class _AsSentDumper(Dumper):
    """A value sent back in binary exactly as PostgreSQL sent it."""

    format = Format.BINARY

    def dump(self, obj: Any) -> bytes:
        return bytes(obj)


class _OidDumper(_AsSentDumper):
    oid = postgres.types["oid"].oid


class _TidDumper(_AsSentDumper):
    oid = postgres.types["tid"].oid


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


class _OidsDumper(_PackedArrayDumper):
    oid = postgres.types["oid"].array_oid
    element_oid = postgres.types["oid"].oid
    element_size = 4


class _XidsDumper(_PackedArrayDumper):
    oid = postgres.types["xid"].array_oid
    element_oid = postgres.types["xid"].oid
    element_size = 4


_HEAD = struct.Struct("!iiI")  # dimensions, has-nulls flag, element type
_DIM = struct.Struct("!ii")  # length, lower bound
_INT = struct.Struct("!i")


def version_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """A binary cursor that reads ``tid``, ``xid`` and ``oid`` as the bytes PostgreSQL sends and
    sends ``Tids``, ``Xids`` and ``Oids`` back as arrays of them (this cursor only: the connection's other users
    read them as usual)."""
    cur = conn.cursor(binary=True)
    cur.adapters.register_loader("tid", ByteaBinaryLoader)
    cur.adapters.register_loader("xid", ByteaBinaryLoader)
    cur.adapters.register_loader("oid", ByteaBinaryLoader)
    cur.adapters.register_dumper(Tids, _TidsDumper)
    cur.adapters.register_dumper(Xids, _XidsDumper)
    cur.adapters.register_dumper(Oids, _OidsDumper)
    cur.adapters.register_dumper(Oid, _OidDumper)
    cur.adapters.register_dumper(Tid, _TidDumper)
    return cur


class VersionGuard:
    row_wait: float | None = ROW_WAIT

    def __init__(self, scheme: Scheme, selection: Selection, dry_run: bool) -> None:
        self.scheme = scheme
        self.selection = selection
        self.target = scheme.target
        self.tree = not self.target.by_ctid  # several heaps: a row version names its table too
        # A dry run writes nothing: it reads no row versions. A row of a tree of tables is read with
        # its table (tableoid) and that table's file: a table rewritten since the read (VACUUM FULL,
        # CLUSTER) keeps each row's xmin but not its ctid, and an inheritance child's ids need not be
        # unique, so only the file tells a rewrite apart.
        names = [] if dry_run else list(row_version_columns(self.target.by_ctid))
        self._extra: list[sql.Composable] = [sql.Identifier(v) for v in names]
        if self.tree and names:
            self._extra.append(sql.SQL("pg_relation_filenode(tableoid)"))
        self._versions = len(self._extra)
        # Rows of one id (an inheritance tree's ids repeat; a partitioned table's primary key
        # covers every partition), in the order of their table and place in it.
        self._then_by: list[sql.Composable] = (
            [sql.Identifier("tableoid"), sql.Identifier("ctid")] if self.target.inherited and names else [])
        self._statements: dict[tuple[int, ...], sql.Composed] = {}
        id_type = sql.Identifier(self.target.id_column.type_name)
        # What the write sends per row: its id, then its row version, as arrays of the same length.
        self._arrays: list[sql.Composable] = [sql.SQL("%b::{}[]").format(id_type)]
        self._keys: list[sql.Composable] = [sql.Identifier("pinrotate_id")]
        # Found by its ctid (one heap fetch per table). The id is still checked: on a plain table a
        # rewrite since the read may have put another row inserted by the same transaction at that
        # ctid, with the same xmin. It is checked with IS NOT DISTINCT FROM (the same as = for a
        # key), which the planner never turns into a second probe of the primary key.
        match: list[sql.Composable] = []
        if self.tree:
            self._arrays.append(sql.SQL("%b::oid[]"))
            self._keys.append(sql.Identifier("pinrotate_tableoid"))
            match.append(sql.SQL("t.tableoid = u.pinrotate_tableoid"))
        self._arrays.append(sql.SQL("%b::tid[]"))
        self._keys.append(sql.Identifier("pinrotate_ctid"))
        match += [sql.SQL("t.ctid = u.pinrotate_ctid"),
                  sql.SQL("t.{} IS NOT DISTINCT FROM u.pinrotate_id").format(selection.id)]
        self._where_row = sql.SQL(" AND ").join(match)  # the row, whatever its version now
        self._arrays.append(sql.SQL("%b::xid[]"))
        self._keys.append(sql.Identifier("pinrotate_xmin"))
        match.append(sql.SQL("t.xmin = u.pinrotate_xmin"))
        if self.tree:
            self._arrays.append(sql.SQL("%b::oid[]"))
            self._keys.append(sql.Identifier("pinrotate_file"))
            match.append(sql.SQL("pg_relation_filenode(t.tableoid) = u.pinrotate_file"))
        self._where_version = sql.SQL(" AND ").join(match)  # the row, still the version read
        # The cautious write's lock: what is free among the rows, by position (1-based); a row an
        # application holds locked is skipped, never waited on.
        self._lock = sql.SQL(
            "SELECT u.pinrotate_n FROM unnest({arrays}) WITH ORDINALITY AS u({keys}, pinrotate_n) "
            "JOIN {rel} AS t ON {match} {lock} OF t SKIP LOCKED"
        ).format(lock=row_lock(self.target), arrays=sql.SQL(", ").join(self._arrays[:-2 if self.tree else -1]),
                 keys=sql.SQL(", ").join(self._keys[:-2 if self.tree else -1]), rel=self.target.relation,
                 match=self._where_row)

    def read(self, conn: psycopg.Connection[Any], lo: Any, hi: Any, size: int) -> list[tuple[Any, ...]]:
        query, params = self.selection.next_batch(lo, hi, size, extra=self._extra, then_by=self._then_by)
        return version_cursor(conn).execute(query, params).fetchall()

    def after(self, row: tuple[Any, ...]) -> Any:
        """On a tree of tables ids repeat: a pass goes on after the last row's (id, tableoid, ctid),
        so that no row of an id the batch ended on is passed over."""
        if not self._then_by:
            return row[0]
        return Position(row[0], (Oid(row[-4]), Tid(row[-3])), ("oid", "tid"))

    def received(self, rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], Any]:
        """(the rows as the scheme reads them, their ids and versions in the same order)."""
        n = self._versions
        if not n:
            return rows, None
        # A few columns of the rows, not a transposition of all of them (this runs for every batch).
        versions = tuple(list(map(operator.itemgetter(i), rows)) for i in (0, *range(-n, 0)))
        return [r[:-n] for r in rows], versions

    def _positions(self, write: Write, read_ids: list[Any]) -> list[int] | None:
        """Where the rows of ``write`` are among the rows read (None: all of them, in order). A row
        is its position, never its id: ids repeat across an inheritance tree."""
        if write.rows is not None:
            return write.rows
        if len(write.ids) == len(read_ids) and all(map(operator.is_, write.ids, read_ids)):
            return None
        # A scheme that does not say which rows it left out: found by id only where no id repeats.
        position = {row_id: i for i, row_id in enumerate(read_ids)}
        if len(position) != len(read_ids):
            raise DatabaseError(f"target {self.target.name}: ids repeat in a batch and scheme {self.scheme.name} "
                                "does not say which rows it writes; nothing written")
        return [position[row_id] for row_id in write.ids]

    def write(self, conn: psycopg.Connection[Any], write: Write, outcome: BatchOutcome, versions: Any,
              cautious: bool) -> None:
        read_ids, *kept = versions
        at = self._positions(write, read_ids)
        held = kept if at is None else [[column[i] for i in at] for column in kept]
        ids, new, weights = write.ids, write.new, write.weights
        sent: list[int] | None = None  # the write's indexes of the rows sent, where some were left out
        if cautious:  # lock what is free, skip what an application holds: never wait on a row
            cur = version_cursor(conn)
            lock_params = [ids, *self._typed(held)[:len(held) - (2 if self.tree else 1)]]
            free = sorted(r[0] - 1 for r in cur.execute(self._lock, lock_params).fetchall())
            if len(free) < len(ids):
                outcome.skipped_locked += len(ids) - len(free)
                if not free:
                    return
                sent = free
                ids = [ids[i] for i in free]
                new = [[column[i] for i in free] for column in new]
                weights = [weights[i] for i in free]
                held = [[column[i] for i in free] for column in held]
        row = version_cursor(conn).execute(self._update(write), [ids, *self._typed(held), *new, len(ids)]).fetchone()
        assert row is not None  # an aggregate: always one row
        count, differ, written = row
        if differ:  # what the database stored is not what was sent: roll back, write again without
            raise NotStored(write, [(p - 1) if sent is None else sent[p - 1] for p in differ])
        if count == len(ids):
            outcome.reencrypted += sum(weights)
            return
        # Some rows changed since they were read: they keep the application's version.
        outcome.reencrypted += sum(weights[p - 1] for p in written or ())
        outcome.changed += len(ids) - count

    def _typed(self, held: list[list[bytes]]) -> list[list[bytes]]:
        """The row versions kept, typed for the statement's arrays."""
        if self.tree:
            tableoid, ctid, xmin, file = held
            return [Oids(tableoid), Tids(ctid), Xids(xmin), Oids(file)]
        ctid, xmin = held
        return [Tids(ctid), Xids(xmin)]

    def _update(self, write: Write) -> sql.Composed:
        """One set-based statement for a write, joined on the row version read; arrays are cast to
        base types (``varchar``, never ``varchar(n)``), so a value too long for its column is an
        error that rolls the batch back, never a silent truncation. It returns what the database
        stored, compared in the server with what was sent (trigger effects included): (rows
        written, positions of rows that differ, positions written if not every row was)."""
        cached = self._statements.get(write.columns)
        if cached is not None:
            return cached
        columns = [self.target.columns[j] for j in write.columns]
        arrays = [*self._arrays, *(sql.SQL("%b::{}[]").format(sql.Identifier(c.type_name)) for c in columns)]
        names = [sql.Identifier(f"n{i}") for i in range(len(columns))]
        sets = [sql.SQL("{} = u.{}").format(sql.Identifier(c.name), n) for c, n in zip(columns, names)]
        stored = [stored_as_sent(c, sql.SQL("u.{}").format(n)) for c, n in zip(columns, names)]
        kv = self.scheme.key_version_column() if isinstance(self.scheme, KeyVersioned) else None
        if kv is not None:
            version = sql.Literal(int(self.scheme.current_key))
            sets.append(sql.SQL("{} = {}").format(sql.Identifier(kv.name), version))
            stored.append(sql.SQL("t.{} IS NOT DISTINCT FROM {}").format(sql.Identifier(kv.name), version))
        # The row version read, still stale and in scope: anything else is someone else's newer row.
        statement = sql.SQL(
            "WITH pinrotate_written AS (UPDATE {rel} AS t SET {sets} "
            "FROM unnest({arrays}) WITH ORDINALITY AS u({keys}, {names}, pinrotate_n) "
            "WHERE {match} AND {guard} RETURNING u.pinrotate_n, {stored} AS pinrotate_stored) "
            "SELECT count(*), array_agg(pinrotate_n) FILTER (WHERE NOT pinrotate_stored), "
            "CASE WHEN count(*) < %b::int8 THEN array_agg(pinrotate_n) END FROM pinrotate_written"
        ).format(rel=self.target.relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
                 keys=sql.SQL(", ").join(self._keys), names=sql.SQL(", ").join(names),
                 match=self._where_version, guard=self.selection.where_t, stored=sql.SQL(" AND ").join(stored))
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
