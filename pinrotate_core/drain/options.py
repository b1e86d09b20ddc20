"""How one drain is asked to run (batch size, workers, deadline, scope, timeouts, hooks), and the
stop rule checked between its batches."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .results import STOP_CANCELLED, STOP_DEADLINE, STOP_KEY_UNAVAILABLE, BatchEvent

if TYPE_CHECKING:
    from ..throttle import Throttle

# Test and instrumentation hook: (batch number, ids read) after a batch is planned, before its write.
BeforeWrite = Callable[[int, Sequence[Any]], None]


@dataclass(frozen=True)
class DrainOptions:
    batch_size: int = 200
    workers: int = 1
    inter_batch_delay: float = 0.0
    deadline: float | None = None  # time.monotonic() value; the rest is left for the next run
    dry_run: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    on_batch: Callable[[BatchEvent], None] | None = None
    run_id: str = ""
    tenant: str | None = None  # only this tenant's rows (targets with a tenant column)
    id_range: tuple[Any, Any] = (None, None)  # a shard: ids in (lo, hi]; None = open end
    # The backlog of id_range as counted when the shard was planned (split_backlog): the drain's
    # backlog_before, not counted again. None or 0: the drain counts it.
    planned_backlog: int | None = None
    shard: str = ""  # the shard's name in log lines ("" when the drain is the whole target)
    lock_timeout: float = 2.0  # seconds a batch waits for a lock before it rolls back
    statement_timeout: float = 30.0  # seconds one statement of a batch may run
    idle_timeout: float = 60.0  # seconds a batch transaction may sit between statements (then the server ends it)
    before_write: BeforeWrite | None = None
    # Sharing the database (the throttle/ package): when set, it gives the batch size and waits
    # between batches instead of inter_batch_delay (in the reader thread, before the next batch is locked).
    throttle: Throttle | None = None


def stop_reason(options: DrainOptions, target_stopped: threading.Event | None = None) -> str | None:
    """Why a drain must stop before its next batch, or None: checked between batches only."""
    if options.stop.is_set():
        return STOP_CANCELLED
    if target_stopped is not None and target_stopped.is_set():
        return STOP_KEY_UNAVAILABLE
    if options.deadline is not None and time.monotonic() >= options.deadline:
        return STOP_DEADLINE
    return None
