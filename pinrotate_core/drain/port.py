"""The drain's port: everything one target's drain asks of its database engine, behind one
interface, so that one drain (``run``) and one batch pipeline (``pipeline``) serve every engine.

An engine gives a ``DrainPort`` (PostgreSQL: ``pg_port.PG_PORT``; MySQL / MariaDB:
``commands.mysql.drain_port.MYSQL_PORT``): its connections and transactions, its driver's errors,
its durability barrier, and per target the ``DrainParts``: the write guard (``guards.Guard``), the
backlog count, the ``fpc1`` pre-pass, and the id bounds of a drain's workers. The drain and the
pipeline never name a driver, a statement or an engine.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import sqlalchemy as sa

from ..schemes.base import Scheme
from ..targets import ResolvedTarget
from .guards import Guard
from .options import DrainOptions
from .results import Tally


class CommitLost(Exception):
    """The connection was lost during a COMMIT: whether the batch committed is unknown."""

    def __init__(self, described: str) -> None:
        super().__init__(described)
        self.described = described


class DrainParts(Protocol):
    """What one drain of one target (or shard) reads and writes through."""

    guard: Guard
    counter: Any  # what ``guard.next_sweep`` counts the backlog with

    def prepare(self, conn: Any) -> None:
        """Before the first batch (there is a backlog): what the guard must read first (MySQL: the
        table's catalog, for its statements)."""

    def count_backlog(self, conn: Any) -> int:
        """Rows (or values, for value-counting schemes) still to move, in scope and in the id range."""

    def hold_failing_keys(self, conn: Any, tally: Tally) -> None:
        """``fpc1`` (no integrity): decrypt every stale value of the WHOLE target once; hold back each
        key one of whose values fails; record the failing rows of this drain's id range in ``tally``.
        Nothing for other schemes."""

    def range_bounds(self, conn: Any, workers: int, backlog: int) -> list[Any]:
        """Ids splitting the drain's range between ``workers`` (empty: one worker)."""


class DrainPort(Protocol):
    # The driver's errors: a batch that fails with one is rolled back and stops the target (exit 4).
    errors: tuple[type[BaseException], ...]
    # A first try's errors after which the batch is written again cautiously (lock wait run out,
    # deadlock), and the errors after which it is written again once more (serialization).
    lock_retry_errors: tuple[type[BaseException], ...]
    serialization_errors: tuple[type[BaseException], ...]

    def describe_error(self, exc: BaseException | None) -> str:
        """The error's class and code only: a server message may quote row values."""

    def parts(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> DrainParts: ...

    def connect(self, engine: sa.Engine) -> AbstractContextManager[Any]:
        """A connection of the drain's own, handed back rolled back."""

    def reading(self, conn: Any, dry_run: bool) -> AbstractContextManager[None]:
        """The drain's first reads (backlog, pre-pass, bounds): read-only in a dry run."""

    def begin_read(self, conn: Any, options: DrainOptions) -> None:
        """Before a batch's read: its own short transaction without row locks (or none)."""

    def end_read(self, conn: Any, ok: bool) -> None:
        """After a batch's read: commit (``ok``) or roll back its transaction."""

    def begin_write(self, conn: Any, target: ResolvedTarget, options: DrainOptions, wait: float | None) -> None:
        """BEGIN a batch's write transaction; ``wait``: its row lock wait (None: the session's)."""

    def commit(self, conn: Any) -> None:
        """COMMIT; ``CommitLost`` when the connection was lost during it (the outcome is unknown)."""

    def rollback(self, conn: Any) -> None:
        """ROLLBACK, quietly: the connection may be gone."""

    def make_durable(self, conn: Any) -> None:
        """The durability barrier after a drain's batches: on return, a crash cannot undo them."""

