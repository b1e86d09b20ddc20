"""The Prefect flow ``pinrotate-rotate`` (deployed from ``flows/rotate.py``, its entry point).

The flow wires the self-contained tasks of ``flows.tasks``: read the current key, plan the shards,
drain every shard on the task runner the configuration names (threads, or Dask worker processes),
verify, report. No key, plaintext or ciphertext is ever a flow parameter, a persisted result or an
artifact.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prefect import flow
from prefect.client.schemas.objects import State
from prefect.context import get_run_context
from prefect.futures import PrefectFuture, as_completed
from prefect.states import Cancelled, Failed
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from flows import reports, traces
from flows.api_watch import (
    ORCHESTRATOR_GRACE_S,
    STOP_SIGNALS,
    ApiWatch,
    OrchestratorLost,
    cancellation_watch,
    quiet_prefect_clients_while_api_away,
    signals_cancel,
)
from flows.runtime import (
    ClusterUnavailable,
    RunCancelled,
    RunEndedWithReport,
    RunFailedClosed,
    RunProgress,
    ShardCancelled,
    api_url,
    batch_lines_at_debug_in_the_ui,
    lines_from_workers,
    quiet_fail_closed_tracebacks,
    start_workers,
    task_runner,
)
from flows.tasks import (
    RunSpec,
    drain_shard,
    merge_shards,
    plan_shards,
    read_current_key,
    recount_backlog,
    result_as_dict,
    result_from_dict,
    retire_gate_report,
    stopped_result,
    verify,
)
from flows.terminal_progress import TargetsProgress, terminal_progress
from flows.throttle import VariableThrottleControl
from flows.worker_logs import batch_progress
from pinrotate_core import rotation
from pinrotate_core.config import load_settings, resolve_config_path
from pinrotate_core.db import database_url, make_engine
from pinrotate_core.drain import (
    STOP_CANCELLED,
    STOP_DB_ERROR,
    STOP_KEY_UNAVAILABLE,
    STOP_ORCHESTRATOR_LOST,
    DrainResult,
)
from pinrotate_core.errors import ConfigError, DatabaseError, KeyUnavailable, PinrotateError
from pinrotate_core.log import configure_stderr_logging, log_event

FLOW_NAME = "pinrotate-rotate"
SHARDS_PER_WORKER = 4  # more shards than workers, so that one slow shard does not hold the run

quiet_fail_closed_tracebacks()
quiet_prefect_clients_while_api_away()
# Before any flow run starts (the CLI, a deployment's worker): Prefect starts the flow run's span,
# the root of the run's trace, before the flow's code runs. Nothing at all without the OTEL variables.
traces.setup_from_environment()


# The flow's own tasks (the plan, verify, the gate report) run on threads of the flow's process; the
# drains have a runner of their own (flows.runtime.task_runner). Prefect types the parameter invariant.
@flow(name=FLOW_NAME, persist_result=False, log_prints=False,
      task_runner=ThreadPoolTaskRunner[Any](max_workers=4))  # type: ignore[arg-type]
def pinrotate_rotate(config_path: str | None = None, dry_run: bool = False, targets: list[str] | None = None,
                     tenant: str | None = None, expected_key_version: str | None = None) -> Any:
    """One rotation run. Parameters name things only: no key, value or secret is ever a parameter."""
    configure_stderr_logging()
    batch_lines_at_debug_in_the_ui()
    traces.check_environment()
    settings = load_settings(config_path)
    flow_run_id = str(get_run_context().flow_run.id)  # type: ignore[union-attr]
    spec = RunSpec(config_path=str(resolve_config_path(config_path).resolve()), run_id=flow_run_id,
                   targets=tuple(targets or ()), dry_run=dry_run, tenant=tenant, expected_key=expected_key_version,
                   deadline=time.time() + settings.job.max_run_duration, traceparent=traces.traceparent())
    # The flow's own connection holds the single-instance lock while the tasks drain on theirs.
    ctx = rotation.open_run(settings, target_names=spec.targets, dry_run=dry_run, expected_key=expected_key_version,
                            tenant=tenant, run_id=flow_run_id,
                            engine=make_engine(database_url(settings), pool_size=1))
    stop = threading.Event()
    try:
        with signals_cancel(flow_run_id, stop), cancellation_watch(flow_run_id, stop) as api:
            spec = dataclasses.replace(spec, current_key=read_current_key(spec))
            with rotation.single_instance(ctx) as got:
                if not got:
                    report = rotation.RunReport(flow_run_id, spec.current_key or "", dry_run)
                    report.skipped = f"another run holds the lock {rotation.LOCK_NAME}"
                    log_event("job_skipped", run_id=flow_run_id, reason="single_instance_lock_held")
                    return report.as_dict()
                return _rotate(ctx, spec, stop, api)
    finally:
        ctx.close()


@dataclass
class _Shard:
    target: str
    shard: str
    id_range: tuple[Any, Any] | None
    rows: int
    exact: bool  # rows was counted, not estimated from a page sample
    result: DrainResult | None = None
    worker: str = ""
    started: bool = False  # the task began draining (not refused, not cancelled first)
    counted: bool = False  # result.backlog_remaining is a count, not a plan or a stale figure
    started_at: float | None = None  # wall clock, from the task: shards overlap, so a target's
    ended_at: float | None = None  # time is its first start to its last end


class ShardDrains:
    """The drain tasks of one run: submitted at once (the runner bounds how many run at a time),
    collected as they finish, each one advancing the progress artifact."""

    def __init__(self, spec: RunSpec, plan: list[dict[str, Any]], progress: RunProgress) -> None:
        self.spec = spec
        self.shards = [_Shard(p["target"], p["shard"], p["id_range"], p["rows"], p["exact"]) for p in plan]
        self.progress = progress
        self.pending: dict[PrefectFuture[dict[str, Any]], _Shard] = {}
        self.orchestrator_lost = False  # a drain's own watch found the Prefect API gone
        self.terminal: TargetsProgress | None = None  # the display on an interactive terminal, if any

    def submit(self, runner: TaskRunner[Any], stop: threading.Event) -> None:
        """Largest planned backlog first, over every target (longest-processing-time first): the
        runner starts them in this order, so the small shards fill in at the end, and no worker is
        left waiting on one big shard that started last while the others have nothing to do."""
        for s in sorted(self.shards, key=lambda s: s.rows, reverse=True):  # stable: plan order among equals
            if stop.is_set():
                break  # cancelled while submitting: the rest stays for the next run
            params = {"spec": self.spec, "target": s.target, "shard": s.shard, "id_range": s.id_range, "rows": s.rows,
                      "exact": s.exact}
            self.pending[runner.submit(drain_shard, params)] = s

    def hold_back(self) -> None:
        """A second Ctrl-C: the shards still queued on the threads never start (their futures are
        cancelled before a task run of theirs exists); the drains running end with the process. A
        Dask shard's worker process gets the Ctrl-C itself (the terminal signals the whole group)."""
        for future in list(self.pending):
            wrapped = getattr(future, "wrapped_future", None)
            if isinstance(wrapped, concurrent.futures.Future):
                wrapped.cancel()  # False once it has started: nothing to hold back then

    def collect(self, stop: threading.Event) -> None:
        """Until every submitted shard has reported."""
        for future in as_completed(list(self.pending)):
            shard = self.pending.pop(future, None)
            if shard is None:
                continue
            shard.result = self._outcome(future, shard, stop)
            # What the shard turned out to hold (moved + left, as counted at its end; rows that
            # failed are still stale, so they are in what is left) replaces its planned backlog in
            # the run's total: a big table's plan is an estimate.
            r = shard.result
            self.progress.advance(r.reencrypted + len(r.failed),
                                  recount=r.reencrypted + r.backlog_remaining - shard.rows, target=shard.target)
            if self.terminal is not None:
                self.terminal.settle(shard.target, r.reencrypted + r.backlog_remaining - shard.rows)

    def _outcome(self, future: PrefectFuture[dict[str, Any]], shard: _Shard, stop: threading.Event) -> DrainResult:
        try:
            doc = future.result(raise_on_failure=True)
        except ShardCancelled as e:  # stopped by the cancellation: its task run is Cancelled, its counts ride along
            doc = e.report
        except Exception as e:  # noqa: BLE001 - whatever ended the task (a lost worker, an abort), the shard is not done
            if stop.is_set():
                # Cancelling: the API refuses to start new task runs; the shard's rows stay for the next run.
                return stopped_result(shard.target, self.spec, e, STOP_CANCELLED, shard.rows)
            shard.started = True
            message = f"target {shard.target} shard {shard.shard}: the task did not finish ({type(e).__name__}: {e})"
            log_event("shard_failed", level=40, run_id=self.spec.run_id, target=shard.target, shard=shard.shard,
                      error=type(e).__name__)
            failed = stopped_result(shard.target, self.spec, DatabaseError(message), STOP_DB_ERROR, shard.rows)
            failed.notes.append(f"shard {shard.shard} did not report: rows it re-encrypted before it ended stay "
                                "re-encrypted but are not in these counts")
            return failed
        shard.worker = str(doc.get("worker", ""))
        self.orchestrator_lost |= bool(doc.get("orchestrator_lost"))
        shard.started = bool(doc.get("started", True))
        shard.started_at, shard.ended_at = doc.get("started_at"), doc.get("ended_at")
        result = result_from_dict(doc)
        shard.counted = (result.stopped not in (STOP_KEY_UNAVAILABLE, STOP_DB_ERROR) if shard.started
                         else shard.exact)
        return result

    def by_target(self) -> dict[str, DrainResult]:
        """One result per target, in the configured order. A shard never started (the run was
        cancelled first) counts as stopped, its planned backlog left for the next run."""
        out: dict[str, list[_Shard]] = {}
        for s in self.shards:
            out.setdefault(s.target, []).append(s)
        return {name: self._target_result(shards) for name, shards in out.items()}

    def _target_result(self, shards: list[_Shard]) -> DrainResult:
        for s in shards:
            if s.result is None:
                s.result = DrainResult(s.target, self.spec.current_key or "", stopped=STOP_CANCELLED,
                                       dry_run=self.spec.dry_run, backlog_before=s.rows, backlog_remaining=s.rows)
                s.counted = s.exact
        merged = merge_shards([s.result for s in shards if s.result is not None])
        starts = [s.started_at for s in shards if s.started_at is not None]
        ends = [s.ended_at for s in shards if s.ended_at is not None]
        if starts and ends:
            merged.duration_ms = (max(ends) - min(starts)) * 1000
        unstarted = sum(1 for s in shards if not s.started)
        if unstarted:
            what = ("cancelled before it started" if unstarted == len(shards) else
                    f"cancelled before {unstarted} of {len(shards)} shards started; their rows stay for the next run")
            if merged.stopped == STOP_CANCELLED and merged.error is None:
                merged.error = what
            else:
                merged.notes.append(what)
        return merged

    def uncounted_targets(self) -> list[str]:
        """Targets whose backlog left is not a count: a shard stopped by an outage or lost, or one
        that never started on an estimated plan. Their backlog is counted again at the end."""
        return list(dict.fromkeys(s.target for s in self.shards if not s.counted))

    def sharded(self) -> list[str]:
        """Targets drained as id ranges (more than one shard): their shards recorded CONFLICTs additively."""
        return sorted({s.target for s in self.shards if s.id_range is not None and tuple(s.id_range) != (None, None)})

    def rows(self) -> list[dict[str, Any]]:
        """Per-shard counts for the report table (names and counts only)."""
        return [{"target": s.target, "shard": s.shard, "worker": s.worker,
                 **{k: v for k, v in rotation.target_report(s.result).items() if k != "failed_rows"}}
                for s in self.shards if s.result is not None]


@contextlib.contextmanager
def operator_watch(progress: RunProgress, variable: str, every: float = 2.0) -> Iterator[None]:
    """While the drains run, keep the progress artifact up to date with the batches, and saying
    whether the operator paused or tuned the run through the throttle Variable (the drains, maybe
    in other processes, obey it themselves)."""
    control = VariableThrottleControl(variable)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every):
            progress.show_operator(control(), variable)
            progress.publish()  # the batches counted since the last look

    watcher = threading.Thread(target=watch, name="pinrotate-operator-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=every + 5)


def _rotate(ctx: rotation.RunContext, spec: RunSpec, stop: threading.Event, api: ApiWatch) -> Any:
    settings = ctx.settings
    # The plan is made while the drains' runner starts (a local Dask cluster spawning and importing
    # its worker processes takes seconds; so may the plans of many targets).
    planning = plan_shards.submit(spec, SHARDS_PER_WORKER * settings.job.max_degree_of_parallelism)
    with task_runner(settings, api_url()) as runner:
        start_workers(runner)
        plan = planning.result()
        progress = RunProgress(spec.run_id, spec.current_key or "", sum(p["rows"] for p in plan))
        drains = ShardDrains(spec, plan, progress)
        title = f"pinrotate run {spec.run_id}: rows to key {spec.current_key}" + (" (dry run)" if spec.dry_run else "")
        with terminal_progress(title) as terminal:
            drains.terminal = terminal
            for p in plan:
                if terminal is not None:
                    terminal.target(p["target"], p["rows"])

            def on_batch(target: str, rows: int) -> None:
                progress.batch(target, rows)
                if terminal is not None:
                    terminal.advance(target, rows)

            with batch_progress(spec.run_id, on_batch), lines_from_workers(runner, spec.run_id), \
                    operator_watch(progress, settings.job.throttle_variable):
                STOP_SIGNALS.hold_back = drains.hold_back
                try:
                    drains.submit(runner, stop)
                    drains.collect(stop)
                finally:
                    STOP_SIGNALS.hold_back = None
    report = rotation.RunReport(spec.run_id, spec.current_key or "", spec.dry_run)
    report.targets = drains.by_target()
    # Sibling shards only added their CONFLICTs: the run's total replaces them now that all ended.
    rotation.record_run_conflicts(ctx, report.targets, drains.sharded())
    report.cancelled = stop.is_set() or any(r.stopped == STOP_CANCELLED for r in report.targets.values())
    report.interrupted = report.cancelled and STOP_SIGNALS.interrupted()
    _recount(spec, report, drains.uncounted_targets())
    results = {name: result_as_dict(r) for name, r in report.targets.items()}
    if api.lost or drains.orchestrator_lost:
        return _orchestrator_lost(ctx, spec, report, results)
    if report.cancelled:
        # Cancelling: the API refuses new task runs, so the last steps run here, directly.
        report.verified = verify.fn(spec, results)
        report.gate = retire_gate_report.fn(spec, results, report.as_dict(), drains.rows())
    else:
        report.verified = verify(spec, results)
        report.gate = retire_gate_report(spec, results, report.as_dict(), drains.rows())
    report.duration_ms = (time.monotonic() - ctx.started) * 1000
    rotation.conclude(ctx, report)
    doc = report.as_dict()
    if report.cancelled:
        moved = sum(t.reencrypted for t in report.targets.values())
        left = sum(t.backlog_remaining for t in report.targets.values())
        summary = f"stopped between batches; {moved} rows re-encrypted stay committed, {left} left for the next run"
        # As for Failed: the data is an exception (a dict would make Prefect's engine log a
        # TypeError traceback in the worker for every cancellation).
        return Cancelled(message=summary, data=RunCancelled(summary, doc))
    if report.exit_code != rotation.EXIT_OK:
        summary = reports.fail_closed_summary(doc)
        # The state's data is an exception (as Prefect expects of a Failed state) whose message is
        # counts and reasons only; the report rides along for an in-process caller.
        return Failed(message=f"stopped fail-closed: {summary}", data=RunFailedClosed(summary, doc))
    return doc


def _recount(spec: RunSpec, report: rotation.RunReport, names: list[str]) -> None:
    """Count again the backlog of targets whose shards could not count theirs, and say in the
    report and the log what its counts do not cover."""
    if names:
        # Cancelling: the API refuses new task runs, so this runs here, directly.
        counted = (recount_backlog.fn if report.cancelled else recount_backlog)(spec, names)
        for name in names:
            if name in counted:
                report.targets[name].backlog_remaining = counted[name]
            else:
                report.targets[name].notes.append("backlog left is the shards' last figure: the database "
                                                  "could not be counted at the end of the run")
    for name, r in report.targets.items():
        for note in r.notes:
            log_event("report_note", level=30, run_id=spec.run_id, target=name, note=note)


def _orchestrator_lost(ctx: rotation.RunContext, spec: RunSpec, report: rotation.RunReport,
                       results: dict[str, dict[str, Any]]) -> Any:
    """The Prefect API stayed unreachable: every drain stopped between batches. Nothing more can be
    reported to Prefect (no task run, no artifact); the report and the one-line reason go to the
    in-process caller (the CLI), the log and the metrics, and the run ends with exit code 4."""
    for r in report.targets.values():
        if r.stopped in (None, STOP_CANCELLED) and r.backlog_remaining:
            r.stopped, r.error = STOP_ORCHESTRATOR_LOST, "the Prefect API stopped answering"
    report.cancelled = False
    report.verified = verify.fn(spec, results)  # the database only
    report.duration_ms = (time.monotonic() - ctx.started) * 1000
    rotation.conclude(ctx, report)
    doc = report.as_dict()
    moved = sum(t.reencrypted for t in report.targets.values())
    left = sum(t.backlog_remaining for t in report.targets.values())
    message = (f"lost the Prefect API for more than {ORCHESTRATOR_GRACE_S:.0f} s; every drain stopped between "
               f"batches: {moved} rows re-encrypted stay committed, {left} left for the next run")
    end = _ON_ORCHESTRATOR_LOST.get()
    if end is not None:
        # The caller's process (the CLI) ends here: Prefect's engine would spend minutes of
        # retries recording a final state with a server that is gone, and record nothing.
        end(RunOutcome(rotation.EXIT_FAIL_CLOSED, {**doc, "error": message}, error=message))
    raise OrchestratorLost(message)


# What the in-process caller does with a run whose Prefect API is gone (see run_flow).
_ON_ORCHESTRATOR_LOST: contextvars.ContextVar[Callable[[RunOutcome], None] | None] = contextvars.ContextVar(
    "pinrotate_on_orchestrator_lost", default=None)


# -- running the flow from the command line and the demo -------------------------------------------------

@dataclass
class RunOutcome:
    """How a run through the flow ended: its report document, or the one-line error without one."""

    exit_code: int
    report: dict[str, Any] | None = None
    error: str | None = None
    state: State[Any] | None = None


def run_flow(on_orchestrator_lost: Callable[[RunOutcome], None] | None = None, **params: Any) -> RunOutcome:
    """Run the flow in this process (the CLI's ``run``, the demo) and read its report from its state.

    ``on_orchestrator_lost``: called with the outcome (exit 4, one line) when the run lost its
    Prefect API and stopped, before Prefect's engine tries to record that; the CLI ends there.
    """
    token = _ON_ORCHESTRATOR_LOST.set(on_orchestrator_lost)
    try:
        state: State[Any] = pinrotate_rotate(return_state=True, **params)  # type: ignore[assignment]
    finally:
        _ON_ORCHESTRATOR_LOST.reset(token)
    data = state.result(raise_on_failure=False)
    if isinstance(data, RunEndedWithReport):
        return RunOutcome(data.report["exit_code"], data.report, state=state)
    if isinstance(data, dict) and "exit_code" in data:
        return RunOutcome(int(data["exit_code"]), data, state=state)
    if isinstance(data, ConfigError):
        return RunOutcome(rotation.EXIT_CONFIG, error=str(data), state=state)
    if isinstance(data, (KeyUnavailable, DatabaseError, ClusterUnavailable, OrchestratorLost)):
        return RunOutcome(rotation.EXIT_FAIL_CLOSED, error=str(data), state=state)
    if isinstance(data, PinrotateError):
        return RunOutcome(rotation.EXIT_UNEXPECTED, error=str(data), state=state)
    name = getattr(state, "name", "unknown")
    return RunOutcome(rotation.EXIT_UNEXPECTED, error=f"the flow run ended {name} without a report", state=state)
