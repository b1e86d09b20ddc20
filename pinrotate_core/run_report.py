"""A run's report (contract §6, ``run --json``), the exit codes of §4 it decides, and what it adds to
the metrics of §7."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .drain import STOP_CANCELLED, DrainResult
from .key_checks import STOP_KEY_MISMATCH
from .schemes.base import NOT_STORED

if TYPE_CHECKING:
    from .metrics import RotationMetrics

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_CONFIG = 2
EXIT_GATE_CLOSED = 3
EXIT_FAIL_CLOSED = 4
EXIT_TERMINATED = 143
EXIT_INTERRUPTED = 130  # the same graceful stop as 143, asked for by a Ctrl-C (SIGINT)


@dataclass
class RunReport:
    run_id: str
    current_key: str
    dry_run: bool
    targets: dict[str, DrainResult] = field(default_factory=dict)
    verified: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)
    cancelled: bool = False
    interrupted: bool = False  # the cancellation was a Ctrl-C (SIGINT): exit 130 rather than 143
    skipped: str | None = None  # e.g. another run holds the single-instance lock
    duration_ms: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.cancelled:
            return EXIT_INTERRUPTED if self.interrupted else EXIT_TERMINATED
        if any(r.stopped == STOP_KEY_MISMATCH for r in self.targets.values()):
            return EXIT_CONFIG  # a worker's keyring disagrees with the recorded key: a refusal, not an outage
        if any(r.fail_closed for r in self.targets.values()):
            return EXIT_FAIL_CLOSED
        if any(not v.get("ok", True) for v in self.verified.values()):
            return EXIT_FAIL_CLOSED
        return EXIT_OK

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "current_key": self.current_key,
            "dry_run": self.dry_run,
            "targets": {name: target_report(r) for name, r in self.targets.items()},
            "verified": self.verified,
            "gate": self.gate,
        }
        if self.cancelled:
            out["stopped"] = STOP_CANCELLED
        if self.skipped:
            out["skipped"] = self.skipped
        out["exit_code"] = self.exit_code
        return out


def target_report(r: DrainResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "reencrypted": r.reencrypted,
        "failed": len(r.failed),
        "conflicts": r.conflicts,
        "backlog_remaining": r.backlog_remaining,
        "batches": r.batches,
        "duration_ms": round(r.duration_ms),
    }
    # The counts the target's scheme keeps in its plans (fpc1: values left as they are, and why).
    out.update({name: n for name, n in r.counts.items() if n})
    if r.stopped:
        out["stopped"] = r.stopped
    if r.error:
        out["error"] = r.error
    if r.notes:
        out["notes"] = list(r.notes)
    if r.failed:
        out["failed_rows"] = [f.as_dict() for f in r.failed[:100]]
    return out


def record_metrics(report: RunReport, metrics: RotationMetrics) -> None:
    """Fold a finished run into the metrics of contract §7 (counts and names only)."""
    for name, r in report.targets.items():
        metrics.set_progress(name, r.backlog_remaining)
        if r.reencrypted and not report.dry_run:
            metrics.add_processed(name, r.reencrypted)
        for reason in ("decrypt_failed", "unknown_key"):
            n = sum(1 for f in r.failed if f.reason == reason)
            if n:
                # A value naming a key the keyring lacks is a key-provider failure, not a bad value.
                metrics.add_error("key_unavailable" if reason == "unknown_key" else reason, n)
        stored_otherwise = sum(1 for f in r.failed if f.reason == NOT_STORED)
        if stored_otherwise:
            # The database stored something other than what was written (a trigger, a truncation):
            # a database-side failure in the contract's fixed reasons (§7), never silently uncounted.
            metrics.add_error("db_error", stored_otherwise)
        if r.conflicts:
            metrics.add_error("conflict", r.conflicts)
        if r.stopped in ("key_unavailable", "db_error"):
            metrics.add_error(r.stopped)
        elif r.stopped == STOP_KEY_MISMATCH:
            metrics.add_error("key_unavailable")  # a worker without the real key: the key alert fires
    metrics.observe_run_duration_ms(report.duration_ms)
    metrics.set_current_key(report.current_key)
    if report.exit_code == EXIT_OK and not report.dry_run:
        metrics.mark_success()
