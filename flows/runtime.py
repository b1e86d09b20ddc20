"""In-process state of the flow runs of this process: contexts, per-target results, progress.

Task parameters stay small and secret-free (a run id and a target name); everything heavy or
secret (engine, keyring) lives here, in memory, for the duration of one flow run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from pinrotate_core import rotation
from pinrotate_core.drain import BatchEvent, DrainResult
from pinrotate_core.errors import PinrotateError
from pinrotate_core.inventory import take_inventory
from pinrotate_core.log import log_event

PROGRESS_EVERY_S = 1.0
CANCEL_POLL_S = 1.0


@dataclass
class _Run:
    ctx: rotation.RunContext
    results: dict[str, DrainResult] = field(default_factory=dict)
    futures: list[Any] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    progress_id: UUID | None = None
    progress_update: Callable[..., Any] | None = None
    progress_total: int = 0
    progress_done: int = 0
    progress_sent: float = 0.0


_RUNS: dict[str, _Run] = {}
_LAST_REPORT: list[rotation.RunReport | None] = [None]
_STOP_ALL = threading.Event()  # set by the CLI's SIGTERM handler: every run of this process stops


def register(ctx: rotation.RunContext) -> None:
    _LAST_REPORT[0] = None
    if _STOP_ALL.is_set():
        ctx.stop.set()
    _RUNS[ctx.run_id] = _Run(ctx)


def unregister(run_id: str) -> None:
    run = _RUNS.pop(run_id, None)
    if run is not None:
        run.ctx.close()


def context(run_id: str) -> rotation.RunContext:
    return _run(run_id).ctx


def _run(run_id: str) -> _Run:
    try:
        return _RUNS[run_id]
    except KeyError:
        raise PinrotateError(f"run {run_id} is not active in this process") from None


def request_stop() -> None:
    """Stop every run of this process between batches (SIGTERM, Ctrl-C)."""
    _STOP_ALL.set()
    for run in list(_RUNS.values()):
        run.ctx.stop.set()


def stop_requested() -> bool:
    return _STOP_ALL.is_set()


def results(run_id: str) -> dict[str, DrainResult]:
    run = _run(run_id)
    with run.lock:
        order = [t.name for t in run.ctx.targets]
        return {n: run.results[n] for n in order if n in run.results}


def record_attempt(run_id: str, result: DrainResult) -> DrainResult:
    """Fold one attempt of a target's drain into its result for the run (retries add up)."""
    run = _run(run_id)
    with run.lock:
        prev = run.results.get(result.target)
        if prev is not None:
            seen = {f.id for f in result.failed}
            result.reencrypted += prev.reencrypted
            result.batches += prev.batches
            result.conflicts += prev.conflicts
            result.duration_ms += prev.duration_ms
            result.backlog_before = max(result.backlog_before, prev.backlog_before)
            result.failed = sorted([*result.failed, *(f for f in prev.failed if f.id not in seen)], key=lambda f: f.id)
            result.sample_ids = list(dict.fromkeys([*result.sample_ids, *prev.sample_ids]))[:64]
        run.results[result.target] = result
        return result


def track(run_id: str, futures: list[Any]) -> None:
    run = _run(run_id)
    with run.lock:
        run.futures.extend(futures)


def wait_for_drains(run_id: str) -> None:
    run = _RUNS.get(run_id)
    if run is None:
        return
    for future in list(run.futures):
        future.wait()


# -- progress -----------------------------------------------------------------------------------

def start_progress(run_id: str, create: Callable[..., UUID], update: Callable[..., Any]) -> None:
    """A progress artifact for the run: share of the backlog at the start that has been handled."""
    run = _run(run_id)
    ctx = run.ctx
    assert ctx.keyring is not None
    inv = take_inventory(ctx.engine, ctx.settings, ctx.keyring, targets=ctx.targets, tenant=ctx.tenant)
    run.progress_total = sum(t.counts["HISTORICAL"] + t.counts["LEGACY"] for t in inv.targets.values())
    run.progress_id = create(progress=0.0 if run.progress_total else 100.0,
                             description=f"pinrotate run {run_id}: rows moved to key {ctx.keyring.current}")
    run.progress_update = update


def progress_hook(run_id: str) -> Callable[[BatchEvent], None]:
    run = _run(run_id)

    def on_batch(event: BatchEvent) -> None:
        with run.lock:
            run.progress_done += event.reencrypted + event.failed
            now = time.monotonic()
            if run.progress_id is None or run.progress_update is None or now - run.progress_sent < PROGRESS_EVERY_S:
                return
            run.progress_sent = now
            share = 100.0 * min(1.0, run.progress_done / run.progress_total) if run.progress_total else 100.0
        run.progress_update(artifact_id=run.progress_id, progress=round(share, 1))

    return on_batch


def _final_progress(run: _Run) -> None:
    if run.progress_id is None or run.progress_update is None:
        return
    share = 100.0 * min(1.0, run.progress_done / run.progress_total) if run.progress_total else 100.0
    run.progress_update(artifact_id=run.progress_id, progress=round(share, 1))


# -- cancellation --------------------------------------------------------------------------------

def watch_cancellation(flow_run_id: str, stop: threading.Event) -> threading.Event:
    """Poll the API for a cancellation of this flow run (UI / API) and turn it into a stop.

    A flow run started outside a worker gets no signal when it is cancelled from the UI; without
    this the drains would carry on until they finish.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    done = threading.Event()

    def poll() -> None:
        client = get_client(sync_client=True)
        with client:
            while not done.wait(CANCEL_POLL_S):
                try:
                    state = client.read_flow_run(UUID(flow_run_id)).state
                except (PrefectHTTPStatusError, OSError):
                    continue  # the API is briefly unreachable: try again, the run goes on
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    log_event("cancel_requested", run_id=flow_run_id)
                    stop.set()
                    return

    threading.Thread(target=poll, name=f"cancel-watch-{flow_run_id[:8]}", daemon=True).start()
    return done


# -- the end of a run ------------------------------------------------------------------------------

def _report(run: _Run) -> rotation.RunReport:
    ctx = run.ctx
    assert ctx.keyring is not None
    report = rotation.RunReport(ctx.run_id, ctx.keyring.current, ctx.dry_run)
    report.targets = results(ctx.run_id)
    report.cancelled = ctx.stop.is_set()
    report.duration_ms = (time.monotonic() - ctx.started) * 1000
    return report


def finish(run_id: str, verify_task: Any, gate_task: Any) -> Any:
    """Verify, gate, metrics, artifacts. The flow run ends Completed, Cancelled (stopped between
    batches) or Failed (stopped fail-closed, exit code 4), with the report attached either way, so
    that the Prefect UI shows a fail-closed run as failed."""
    from prefect.states import Cancelled, Failed

    run = _run(run_id)
    ctx = run.ctx
    report = _report(run)
    if report.cancelled:
        # Cancelling: the API may refuse new task runs, so the last steps run directly.
        report.verified = rotation.verify(ctx, report.targets)
        report.gate = rotation.gate_report(ctx, report.targets)
    else:
        report.verified = verify_task(run_id)
        report.gate = gate_task(run_id, report.as_dict())
    _final_progress(run)
    _conclude(ctx, report)
    if report.cancelled:
        return Cancelled(message="stopped between batches; committed batches stay", data=report.as_dict())
    if report.exit_code != rotation.EXIT_OK:
        return Failed(message=f"stopped fail-closed: {fail_closed_summary(report)}", data=report.as_dict())
    return report.as_dict()


def fail_closed_summary(report: rotation.RunReport) -> str:
    """Which targets failed closed and why, by name and count only."""
    parts = []
    for name, r in report.targets.items():
        if r.stopped in ("key_unavailable", "db_error"):
            parts.append(f"{name} stopped ({r.stopped})")
        if r.failed:
            parts.append(f"{name}: {len(r.failed)} rows left unchanged")
        if r.conflicts:
            parts.append(f"{name}: {r.conflicts} conflicts")
    unverified = [n for n, v in report.verified.items() if not v.get("ok", True)]
    if unverified:
        parts.append(f"verification failed for {', '.join(unverified)}")
    return "; ".join(parts) or f"exit code {report.exit_code}"


def finish_after_stop(run_id: str) -> None:
    """SIGTERM path: the drains have stopped; record what was committed, without new tasks."""
    run = _RUNS.get(run_id)
    if run is None or run.ctx.keyring is None:
        return
    report = _report(run)
    report.cancelled = True
    _conclude(run.ctx, report)


def _conclude(ctx: rotation.RunContext, report: rotation.RunReport) -> None:
    rotation.conclude(ctx, report)
    set_last_report(report)


def set_last_report(report: rotation.RunReport) -> None:
    _LAST_REPORT[0] = report


def last_report() -> rotation.RunReport | None:
    return _LAST_REPORT[0]


def gate_markdown(report: dict[str, Any]) -> str:
    """The run report for people: counts, names and the gate per older key. Never a value."""
    lines = [f"# pinrotate run `{report['run_id']}`", "",
             f"Current key: **{report['current_key']}**" + (" (dry run)" if report["dry_run"] else ""), "",
             "| target | re-encrypted | failed | conflicts | backlog left | batches | ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, t in report["targets"].items():
        lines.append(f"| {name} | {t['reencrypted']} | {t['failed']} | {t['conflicts']} | "
                     f"{t['backlog_remaining']} | {t['batches']} | {t['duration_ms']} |")
    lines += ["", "## Retire gate", "", "| key | gate | blocking |", "|---|---|---|"]
    for key, g in report.get("gate", {}).items():
        blocking = ", ".join(f"{c} {n}" for c, n in g["blocking"].items()) or "nothing"
        lines.append(f"| {key} | {'OPEN' if g['open'] else 'closed'} | {blocking} |")
    if not report.get("gate"):
        lines.append("| (no older key in the keyring) | | |")
    return "\n".join(lines) + "\n"
