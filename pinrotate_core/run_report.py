"""A run's report (contract §6, ``run --json``) and the exit codes of §4 it decides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .drain import STOP_CANCELLED, DrainResult
from .key_checks import STOP_KEY_MISMATCH

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
