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

Row versions travel in binary as PostgreSQL sends them: read as bytes, sent back as one array each
(the PostgreSQL room's ``row_versions``, which also holds the statements). It never runs a batch itself.
"""

from __future__ import annotations

import operator
from typing import Any, Protocol, runtime_checkable

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ..db import raw_connection
from ..engines.postgresql.row_versions import Oid, Tid, VersionStatements, typed, version_cursor
from ..errors import DatabaseError
from ..schemes.base import Scheme, Write
from ..targets import Column, row_lock, row_version_columns
from .counting import BacklogCounter
from .guards import EachWrite, Sweep
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


class VersionGuard(EachWrite):
    row_wait: float | None = ROW_WAIT

    def __init__(self, scheme: Scheme, selection: Selection, dry_run: bool) -> None:
        self.scheme = scheme
        self.selection = selection
        self.target = scheme.target
        self.tree = not self.target.by_ctid  # several heaps: a row version names its table too
        # A dry run writes nothing: it reads no row versions.
        names = [] if dry_run else list(row_version_columns(self.target.by_ctid))
        self._sql = VersionStatements(self.target.relation, selection.id, self.target.id_column.type_name, names,
                                      tree=self.tree, inherited=self.target.inherited, lock=row_lock(self.target))
        self._extra = self._sql.extra
        self._versions = len(self._extra)
        self._then_by = self._sql.then_by
        self._statements: dict[tuple[int, ...], sql.Composed] = {}

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
            free = sorted(r[0] - 1 for r in cur.execute(self._sql.lock, self._sql.lock_params(ids, held)).fetchall())
            if len(free) < len(ids):
                outcome.skipped_locked += len(ids) - len(free)
                if not free:
                    return
                sent = free
                ids = [ids[i] for i in free]
                new = [[column[i] for i in free] for column in new]
                weights = [weights[i] for i in free]
                held = [[column[i] for i in free] for column in held]
        row = version_cursor(conn).execute(self._update(write), [ids, *typed(held, self.tree), *new, len(ids)]).fetchone()
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

    def _update(self, write: Write) -> sql.Composed:
        """One set-based statement for a write (``VersionStatements.update``: joined on the row
        version read, still stale and in scope; what the database stored compared with what was
        sent), cached per set of columns written."""
        cached = self._statements.get(write.columns)
        if cached is not None:
            return cached
        columns = [self.target.columns[j] for j in write.columns]
        kv = self.scheme.key_version_column() if isinstance(self.scheme, KeyVersioned) else None
        statement = self._sql.update([(c.name, c.type_name) for c in columns],
                                     None if kv is None else (kv.name, int(self.scheme.current_key)),
                                     self.selection.where_t)
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
