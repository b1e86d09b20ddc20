"""The write guard port: what a batch pipeline asks of the strategy that keeps its writes safe
against an application writing the same rows (``guard_lock.py``: a row lock; ``guard_cas.py``:
compare-and-swap on the value read). Each guard owns its statements, how a write that missed is
settled, what is swept after the passes and whether conflicts are recorded; the pipeline never
asks which guard it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ..schemes.base import Write
from .counting import BacklogCounter
from .options import DrainOptions
from .results import BatchOutcome, DrainResult, Tally


@dataclass(frozen=True)
class Sweep:
    """What a guard wants swept after the passes (rows skipped because someone else held them locked)."""

    due: bool  # is there anything to try again?
    only: frozenset[Any] | None = None  # the rows to try again; None: every stale row of the range
    backlog: int | None = None  # the backlog as counted before the sweep; None: not counted


class Guard(Protocol):
    def select(self, lo: Any, hi: Any, size: int) -> tuple[sql.Composed, list[Any]]:
        """The statement reading (and, where the guard locks, locking) the next batch after ``lo``."""

    def write(self, conn: psycopg.Connection[Any], write: Write, outcome: BatchOutcome) -> None:
        """One write of a batch, in its open transaction, counted into ``outcome``."""

    def next_sweep(self, engine: sa.Engine, counter: BacklogCounter, tally: Tally) -> Sweep:
        """What to try again after a pass (or a sweep) that left rows behind."""

    def record_conflicts(self, conn: psycopg.Connection[Any] | None, result: DrainResult,
                         options: DrainOptions) -> None:
        """Save the drain's CONFLICT counts for the gate; ``conn`` None: the database could not be
        reached, fail closed."""
