"""The row-lock write guard (aesgcm, vault-transit): a batch's rows are locked
``FOR NO KEY UPDATE SKIP LOCKED`` when read and written while locked, so a write can never miss.
Rows an application held locked are skipped and swept up after the pass while the recount finds
rows left that did not fail. It owns its statements; it never runs a batch itself."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ..db import raw_connection
from ..errors import DatabaseError
from ..schemes.base import Scheme, Write
from ..targets import Column
from .counting import BacklogCounter
from .guards import Sweep
from .options import DrainOptions
from .results import BatchOutcome, DrainResult, Tally
from .selection import Selection


@runtime_checkable
class KeyVersioned(Protocol):
    """A scheme whose rows carry a key-version column, set to the current version by every write."""

    def key_version_column(self) -> Column | None: ...


class LockGuard:
    def __init__(self, scheme: Scheme, selection: Selection, dry_run: bool) -> None:
        self.scheme = scheme
        self.selection = selection
        self.target = scheme.target
        self._locks = not dry_run  # a dry run reads without locks: it writes nothing
        self._statements: dict[tuple[int, ...], sql.Composed] = {}

    def select(self, lo: Any, hi: Any, size: int) -> tuple[sql.Composed, list[Any]]:
        return self.selection.next_batch(lo, hi, size, lock=self._locks)

    def write(self, conn: psycopg.Connection[Any], write: Write, outcome: BatchOutcome) -> None:
        cur = conn.cursor(binary=True)
        cur.execute(self._update(write), [write.ids, *write.new])
        if cur.rowcount != len(write.ids):
            # Cannot happen while we hold the row locks; if it does, write nothing.
            raise DatabaseError(f"target {self.target.name}: batch updated {cur.rowcount} rows, "
                                f"expected {len(write.ids)}")
        outcome.reencrypted += sum(write.weights)

    def _update(self, write: Write) -> sql.Composed:
        """One set-based statement for a write; arrays are cast to base types (``varchar``, never
        ``varchar(n)``), so a value too long for its column is an error that rolls the batch back,
        never a silent truncation."""
        cached = self._statements.get(write.columns)
        if cached is not None:
            return cached
        columns = [self.target.columns[j] for j in write.columns]
        arrays: list[sql.Composable] = [sql.SQL("%b::{}[]").format(sql.Identifier(self.target.id_column.type_name))]
        arrays += [sql.SQL("%b::{}[]").format(sql.Identifier(c.type_name)) for c in columns]
        names = [sql.Identifier(f"n{i}") for i in range(len(columns))]
        sets = [sql.SQL("{} = u.{}").format(sql.Identifier(c.name), n) for c, n in zip(columns, names)]
        kv = self.scheme.key_version_column() if isinstance(self.scheme, KeyVersioned) else None
        if kv is not None:
            sets.append(sql.SQL("{} = {}").format(sql.Identifier(kv.name), sql.Literal(int(self.scheme.current_key))))
        # Guard: the locked row is still stale and in scope (it cannot have changed, but never write blind).
        statement = sql.SQL(
            "UPDATE {rel} AS t SET {sets} FROM unnest({arrays}) AS u(pinrotate_id, {names}) "
            "WHERE t.{id} = u.pinrotate_id AND {guard}"
        ).format(rel=self.target.relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
                 names=sql.SQL(", ").join(names), id=self.selection.id, guard=self.selection.where_t)
        self._statements[write.columns] = statement
        return statement

    def next_sweep(self, engine: sa.Engine, counter: BacklogCounter, tally: Tally) -> Sweep:
        """Sweep the whole range again while rows are left that did not fail: SKIP LOCKED passed over
        rows that a live transaction held."""
        with raw_connection(engine) as conn:
            left, unfailed = counter.count_left(conn, tally.failed_ids())
        return Sweep(due=unfailed > 0, backlog=left)

    def record_conflicts(self, conn: psycopg.Connection[Any] | None, result: DrainResult,
                         options: DrainOptions) -> None:
        """A locked row cannot change under its write: there is never a CONFLICT to record."""
