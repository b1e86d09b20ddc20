"""The compare-and-swap write guard (fpc1): rows are read without locks; each column is written
only where it still holds the value read, and the write locks its rows ``SKIP LOCKED`` so it never
waits on an application. A miss is settled: moved already by another run (not a conflict), held
locked by someone else (left for the sweep), or a CONFLICT, recorded for the gate. What the
database stored is returned and compared with what was sent, every row (``NotStored``). A row is
found by its id, unique on a plain or partitioned table: a table with inheritance children, whose
ids may repeat, is BLOCKED for this guard (targets.py)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ..conflicts import NO_TENANT, StateError, record_conflicts
from ..engines.postgresql import guard_cas as pg_cas
from ..schemes.base import Scheme, Write
from ..targets import Column, row_lock
from .counting import BacklogCounter
from .guards import EachWrite, Sweep
from .options import DrainOptions
from .results import CONFLICTS_UNRECORDED, BatchOutcome, DrainResult, NotStored, Tally
from .selection import Selection


@runtime_checkable
class SettlesMisses(Protocol):
    """What a scheme written by compare-and-swap adds: how to tell a value another run moved from
    an application's edit."""

    def settled(self, column: Column, read: Any, now: Any) -> bool:
        """After a CAS miss: is ``now`` the value ``read``, moved to the current key by another run
        (same plaintext), rather than an application's edit (a CONFLICT)?"""


class CasGuard(EachWrite):
    def __init__(self, scheme: Scheme, selection: Selection, dry_run: bool) -> None:
        if not isinstance(scheme, SettlesMisses):
            raise TypeError(f"scheme {scheme.name}: a compare-and-swap guard needs settled()")
        self.scheme: SettlesMisses = scheme
        self.selection = selection
        self.target = scheme.target
        self._statements: dict[tuple[int, ...], sql.Composed] = {}

    row_wait: float | None = None  # the write never waits on a row: it locks SKIP LOCKED itself

    def read(self, conn: psycopg.Connection[Any], lo: Any, hi: Any, size: int) -> list[tuple[Any, ...]]:
        query, params = self.selection.next_batch(lo, hi, size)
        return conn.cursor(binary=True).execute(query, params).fetchall()

    @staticmethod
    def after(row: tuple[Any, ...]) -> Any:
        return row[0]  # ids are unique: an inheritance tree is BLOCKED for this guard

    def received(self, rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], Any]:
        return rows, None  # the values read are the versions compared: the write carries them

    def _update(self, write: Write) -> sql.Composed:
        """One set-based statement for a write: (true, id) per row written, (false, id) per row
        locked; a row an application holds locked is neither."""
        cached = self._statements.get(write.columns)
        if cached is not None:
            return cached
        columns = [self.target.columns[j] for j in write.columns]
        statement = pg_cas.update(self.target.relation, self.selection.id, self.target.id_column.type_name,
                                  [(c.name, c.type_name) for c in columns], self.selection.scope_t,
                                  row_lock(self.target))
        self._statements[write.columns] = statement
        return statement

    def write(self, conn: psycopg.Connection[Any], write: Write, outcome: BatchOutcome, versions: Any,
              cautious: bool) -> None:
        params: list[Any] = [write.ids]
        for old, new in zip(write.old, write.new):
            params += [old, new]
        matched: set[Any] = set()
        locked: set[Any] = set()
        differ: set[Any] = set()
        for moved, row_id, stored in conn.execute(self._update(write), params).fetchall():
            (matched if moved else locked).add(row_id)
            if not stored:
                differ.add(row_id)
        if differ:  # the database stored something else (a trigger): roll back, write again without
            raise NotStored(write, [i for i, row_id in enumerate(write.ids) if row_id in differ])
        # Not locked: someone else holds the row (or it is gone); locked but not written: a miss.
        missed = [i for i, row_id in enumerate(write.ids) if row_id not in matched]
        settled, held = self._settle_misses(conn, write, missed, locked) if missed else (set(), set())
        column = ",".join(self.target.columns[j].name for j in write.columns)
        for i, row_id in enumerate(write.ids):
            if row_id in matched:
                outcome.reencrypted += write.weights[i]
            elif row_id in settled:
                outcome.settled += write.weights[i]
            elif row_id in held:
                outcome.held.append(row_id)
            else:
                outcome.conflicts += write.weights[i]
                outcome.lost.append((row_id, column, write.tenants[i] or NO_TENANT, write.weights[i]))

    def _settle_misses(self, conn: psycopg.Connection[Any], write: Write, missed: list[int],
                       locked: set[Any]) -> tuple[set[Any], set[Any]]:
        """(settled, held) among the rows missed: a miss whose value is already on the current key
        was moved by another run, not a conflict. A row we could not lock that is still there (in
        scope) is held by someone else: left as it is, for the sweep. A row that is gone is a
        conflict, as before."""
        s = self.selection
        columns = [self.target.columns[j] for j in write.columns]
        query = pg_cas.missed_rows(self.target.relation, s.id, [c.name for c in columns], s.scope)
        read = {write.ids[i]: [old[i] for old in write.old] for i in missed}
        settled: set[Any] = set()
        held: set[Any] = set()
        for row in conn.execute(query, [list(read)]).fetchall():
            if row[0] not in locked:
                held.add(row[0])
            elif all(self.scheme.settled(c, r, v) for c, r, v in zip(columns, read[row[0]], row[1:])):
                settled.add(row[0])
        return settled, held

    def next_sweep(self, engine: sa.Engine, counter: BacklogCounter, tally: Tally) -> Sweep:
        """Only the rows an application held locked at the write are tried again (a conflict is left
        as it is, for the next run to read afresh)."""
        held = tally.take_held()
        return Sweep(due=bool(held), only=held)

    def record_conflicts(self, conn: psycopg.Connection[Any] | None, result: DrainResult,
                         options: DrainOptions) -> None:
        if conn is None:
            result.state_error = CONFLICTS_UNRECORDED
            return
        try:
            # A shard (an id range) adds its conflicts and clears nothing: its siblings' are not
            # its own (record_run_conflicts replaces them once all have ended).
            record_conflicts(conn, self.target.name, result.conflicts_by_tenant, tenant_scope=options.tenant,
                             complete=result.stopped is None, run_id=options.run_id,
                             shard=options.id_range != (None, None))
        except StateError as e:
            result.state_error = str(e)
