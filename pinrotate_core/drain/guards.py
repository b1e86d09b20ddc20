"""The write guard port: what a batch pipeline asks of the strategy that keeps its writes safe
against an application writing the same rows (``guard_version.py``: compare-and-swap on the row
version read; ``guard_cas.py``: compare-and-swap on the value read). Both read without row locks,
so no row is locked while its batch is re-encrypted. Each guard owns its statements (composed by
the PostgreSQL room: ``engines/postgresql/row_versions.py``, ``guard_cas.py``; MySQL / MariaDB: ``commands/mysql/drain_port.py``), how a write that
missed is settled, what is swept after the passes and whether conflicts are recorded; the
pipeline never asks which guard it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa

from ..schemes.base import BatchPlan, Write
from .options import DrainOptions
from .results import BatchOutcome, DrainResult, Tally


@dataclass(frozen=True)
class Sweep:
    """What a guard wants swept after the passes (rows skipped because someone else held them locked)."""

    due: bool  # is there anything to try again?
    only: frozenset[Any] | None = None  # the rows to try again; None: every stale row of the range
    backlog: int | None = None  # the backlog as counted before the sweep; None: not counted


class Guard(Protocol):
    # Seconds the first try of a batch's write may wait for a row lock an application holds; past
    # that (or on a deadlock) the pipeline rolls it back and writes it again with ``cautious``.
    # None: the write never waits on a row, there is no second try.
    row_wait: float | None

    def read(self, conn: Any, lo: Any, hi: Any, size: int) -> list[tuple[Any, ...]]:
        """The next batch after ``lo`` (an id, or what ``after`` returned; up to the id ``hi``),
        read in the open read transaction without row locks."""

    def after(self, row: tuple[Any, ...]) -> Any:
        """Where the next batch begins: after ``row``, the last one read (as ``read`` returned it)."""

    def received(self, rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], Any]:
        """(the rows as the scheme plans them, what the guard keeps of them for the write)."""

    def write_batch(self, conn: Any, plan: BatchPlan, outcome: BatchOutcome, versions: Any, cautious: bool) -> None:
        """Every write of a batch in its open transaction, counted into ``outcome``; ``versions``:
        what ``received`` kept; ``cautious``: the second try, which must not wait on any row.
        ``EachWrite``: one ``write`` per write of the plan."""

    def next_sweep(self, engine: sa.Engine, counter: Any, tally: Tally) -> Sweep:
        """What to try again after a pass (or a sweep) that left rows behind."""

    def record_conflicts(self, conn: Any | None, result: DrainResult,
                         options: DrainOptions) -> None:
        """Save the drain's CONFLICT counts for the gate; ``conn`` None: the database could not be
        reached, fail closed."""


class EachWrite:
    """``write_batch`` as a guard that writes each of a plan's writes with its own statement does it."""

    def write(self, conn: Any, write: Write, outcome: BatchOutcome, versions: Any, cautious: bool) -> None:
        """One write of a batch, in its open transaction, counted into ``outcome``."""
        raise NotImplementedError

    def write_batch(self, conn: Any, plan: BatchPlan, outcome: BatchOutcome, versions: Any, cautious: bool) -> None:
        for write in plan.writes:
            if write.ids:
                self.write(conn, write, outcome, versions, cautious)
