"""What a drain reports: why it stopped, one event per batch, the result of a target, and the
per-target tally its workers share (counts, failed rows, conflicts, the sample the verify step
re-reads). No SQL and no I/O here.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DatabaseError
from ..schemes.base import BatchPlan, FailedRow, Write

# Why a drain stopped before its backlog was empty.
STOP_KEY_UNAVAILABLE = "key_unavailable"
STOP_DB_ERROR = "db_error"
STOP_CANCELLED = "cancelled"
STOP_DEADLINE = "deadline"
STOP_THROTTLE_CRITICAL = "throttle_critical"  # a critical_* health limit was exceeded (exit 4)
# The run's orchestrator (the flows' Prefect API) stopped answering: stopped between batches (exit 4).
STOP_ORCHESTRATOR_LOST = "orchestrator_lost"

SAMPLE_SIZE = 64


@dataclass(frozen=True)
class BatchEvent:
    target: str
    worker: int
    batch: int
    rows: int
    reencrypted: int
    failed: int
    duration_ms: float  # lock (or read) to commit, without the pause between batches
    dry_run: bool
    conflicts: int = 0


@dataclass
class DrainResult:
    target: str
    current_key: str
    reencrypted: int = 0  # rows (aesgcm, vault-transit) or values (fpc1)
    failed: list[FailedRow] = field(default_factory=list)
    conflicts: int = 0
    batches: int = 0
    duration_ms: float = 0.0
    backlog_before: int = 0
    backlog_remaining: int = 0
    stopped: str | None = None
    error: str | None = None
    retryable: bool = False
    dry_run: bool = False
    sample_ids: list[Any] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # scheme counts: active, unknown, unknown_key, ...
    conflicts_by_tenant: dict[str, int] = field(default_factory=dict)
    state_error: str | None = None  # the CONFLICT counts could not be saved for the gate
    notes: list[str] = field(default_factory=list)  # what the counts do not say (counts lost with a worker, ...)

    @property
    def unknown(self) -> int:
        return self.counts.get("unknown", 0)

    @property
    def unknown_key(self) -> int:
        return self.counts.get("unknown_key", 0)

    @property
    def legacy_left(self) -> int:
        return self.counts.get("legacy_left", 0)

    @property
    def fail_closed(self) -> bool:
        """True when the run must report exit code 4 for this target."""
        return (self.stopped in (STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL, STOP_ORCHESTRATOR_LOST)
                or bool(self.failed)
                or self.conflicts > 0 or self.state_error is not None)


def natural_id_order(row_id: str) -> tuple[int, int, str]:
    """Ids in the order an operator expects: numbers numerically (1, 2, 10), then the rest as text."""
    return (0, int(row_id), "") if row_id.isdigit() else (1, 0, row_id)


def first_reason(reasons: Sequence[str | None]) -> str | None:
    """The stop reason of a drain whose workers stopped for ``reasons``: the most severe."""
    order = [STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL, STOP_CANCELLED, STOP_DEADLINE]
    present = [r for r in reasons if r]
    return min(present, key=order.index) if present else None


class CommitUnknown(DatabaseError):
    """The connection was lost while a batch's COMMIT was in flight: it may have committed or not.
    Never reported as rolled back; the drain recounts the backlog from the database."""

    def __init__(self, target: str, rows: int, cause: str) -> None:
        super().__init__(f"target {target}: the outcome of a batch's COMMIT is unknown ({cause}): its {rows} "
                         "row(s) may or may not have been re-encrypted; the backlog is recounted")
        self.rows = rows


def commit_unknown_note(rows: int) -> str:
    """A drain's note when a batch's COMMIT outcome is unknown (``CommitUnknown``), on every engine."""
    return (f"up to {rows} row(s) of a batch whose COMMIT outcome is unknown may have been re-encrypted beyond "
            "the count; the backlog left is recounted")


class NotStored(Exception):
    """A write whose RETURNING showed rows holding something other than the values written (a
    BEFORE UPDATE trigger kept or changed them): the batch is rolled back and written again without
    them, each FAILED (``NOT_STORED``). ``positions``: indexes into ``write.ids``."""

    def __init__(self, write: Write, positions: Sequence[int]) -> None:
        super().__init__(f"{len(positions)} row(s) did not store the value written")
        self.write = write
        self.positions = list(positions)


# A drain's CONFLICT counts that never reached the database: the drain stays fail-closed (exit 4).
CONFLICTS_UNRECORDED = "the CONFLICT counts could not be recorded: the database was unreachable"


class NotStoredRows(Exception):
    """As ``NotStored``, for a guard that writes a batch's rows whole (every column of a row in one
    statement): ``ids`` are rows, whatever writes of the plan they are in."""

    def __init__(self, ids: Collection[Any]) -> None:
        super().__init__(f"{len(ids)} row(s) did not store the value written")
        self.ids = set(ids)


@dataclass
class BatchOutcome:
    """What one batch's writes did, counted only once its COMMIT is confirmed."""

    reencrypted: int = 0
    conflicts: int = 0
    settled: int = 0  # CAS misses whose value another run had already moved
    lost: list[tuple[Any, str, str, int]] = field(default_factory=list)  # (id, column, tenant, values)
    held: list[Any] = field(default_factory=list)  # cas: ids of rows someone else held locked, left for the sweep
    skipped_locked: int = 0  # version: rows an application held locked at a cautious write, left for the sweep
    changed: int = 0  # version: rows changed by someone else since they were read, left as they were
    committed: float = 0.0  # perf_counter() at COMMIT


class Tally:
    """Per-target counters shared by the workers of one drain."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reencrypted = 0
        self.conflicts = 0
        self.batches = 0
        self.counts: dict[str, int] = {}
        self.conflicts_by_tenant: dict[str, int] = {}
        self.failed: dict[tuple[str, str], FailedRow] = {}
        self.held: set[Any] = set()  # cas: rows someone else held locked at the write, for the sweep
        self.error: BaseException | None = None
        self.commit_unknown = 0  # rows of batches whose COMMIT outcome is unknown (not counted)
        self.sample: list[Any] = []  # reservoir of re-encrypted ids, re-read by the verify step
        self._seen = 0
        self._rng = random.Random()

    def add(self, plan: BatchPlan, outcome: BatchOutcome) -> None:
        with self.lock:
            self.reencrypted += outcome.reencrypted
            self.conflicts += outcome.conflicts
            self.batches += 1
            for name, n in plan.counts.items():
                self.counts[name] = self.counts.get(name, 0) + n
            if outcome.settled:
                self.counts["settled_elsewhere"] = self.counts.get("settled_elsewhere", 0) + outcome.settled
            self.held.update(outcome.held)
            for _, _, tenant, n in outcome.lost:
                self.conflicts_by_tenant[tenant] = self.conflicts_by_tenant.get(tenant, 0) + n
            for f in plan.failed:
                self.failed.setdefault((f.id, f.reason), f)
            ids = plan.writes[0].ids if len(plan.writes) == 1 else plan.ids
            if ids:
                for row_id in (ids[0], self._rng.choice(ids)):
                    self._seen += 1
                    if len(self.sample) < SAMPLE_SIZE:
                        self.sample.append(row_id)
                    else:
                        slot = self._rng.randrange(self._seen)
                        if slot < SAMPLE_SIZE:
                            self.sample[slot] = row_id

    def failed_ids(self) -> frozenset[str]:
        with self.lock:
            return frozenset(i for i, _ in self.failed)

    def take_held(self) -> frozenset[Any]:
        """The rows left because someone else held them locked, forgotten here (a sweep tries them again)."""
        with self.lock:
            held, self.held = frozenset(self.held), set()
            return held

    def fill(self, result: DrainResult, reason: str | None) -> None:
        """Copy what the workers counted into ``result``, stopped for ``reason``."""
        with self.lock:
            result.reencrypted = self.reencrypted
            result.conflicts = self.conflicts
            result.batches = self.batches
            result.counts = dict(self.counts)
            result.conflicts_by_tenant = dict(self.conflicts_by_tenant)
            result.failed = sorted(self.failed.values(), key=lambda f: (natural_id_order(f.id), f.reason))
            result.sample_ids = list(dict.fromkeys(self.sample))
            result.stopped = reason
            if self.commit_unknown:
                result.notes.append(commit_unknown_note(self.commit_unknown))
            if self.error is not None:
                result.error = str(self.error)
                result.retryable = bool(getattr(self.error, "retryable", isinstance(self.error, DatabaseError)))
