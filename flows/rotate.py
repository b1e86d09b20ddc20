"""The Prefect flow ``pinrotate-rotate`` and the entry point ``python -m flows.rotate``.

Thin by design: each task wraps one call into ``pinrotate_core.rotation``. No key, plaintext or
ciphertext ever becomes a flow parameter, a task result that is persisted, or an artifact.
"""

from __future__ import annotations

if __name__ == "__main__":
    # The command line comes first so that --help, inventory, gate and keys answer without
    # importing Prefect at all; only `run` and `demo` import this module again, as a library.
    from flows.cli import main

    raise SystemExit(main())

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.context import get_run_context
from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectFuture
from prefect.states import State
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import Task, exponential_backoff

from flows import runtime
from flows.throttle import VariableThrottleControl
from pinrotate_core import rotation
from pinrotate_core.config import load_settings
from pinrotate_core.errors import DatabaseError, KeyUnavailable
from pinrotate_core.log import configure_stderr_logging, log_event

FLOW_NAME = "pinrotate-rotate"
MAX_TASK_THREADS = 8


def _retryable(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry only what trying again can fix: an outage, a timeout, a sealed Vault; never a 403."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            state.result(raise_on_failure=True)
        except (KeyUnavailable, DatabaseError) as e:
            exc = e
        except BaseException:  # noqa: BLE001 - anything else is not ours to retry
            return False
    if runtime.stop_requested():
        return False
    return isinstance(exc, (KeyUnavailable, DatabaseError)) and bool(getattr(exc, "retryable", True))


@task(name="read_current_key", retries=4, retry_delay_seconds=exponential_backoff(backoff_factor=2),
      retry_jitter_factor=0.3, retry_condition_fn=_retryable, persist_result=False, cache_policy=NO_CACHE)
def read_current_key(run_id: str) -> str:
    """Read the keyring once for the run; returns the current key id only (never material)."""
    ctx = runtime.context(run_id)
    keyring = rotation.read_current_key(ctx)
    rotation.resolve_all(ctx)
    return keyring.current


@task(name="drain_target", task_run_name="drain-{target}", retries=3, retry_delay_seconds=[2, 10, 30],
      retry_jitter_factor=0.3, retry_condition_fn=_retryable, persist_result=False, cache_policy=NO_CACHE)
def drain_target(run_id: str, target: str, workers: int) -> dict[str, Any]:
    """Drain one target; a retryable fail-closed stop raises so that Prefect retries with backoff."""
    ctx = runtime.context(run_id)
    result = rotation.drain(ctx, target, workers=workers, on_batch=runtime.progress_hook(run_id))
    merged = runtime.record_attempt(run_id, result)
    if result.stopped in ("key_unavailable", "db_error") and result.retryable and not ctx.stop.is_set():
        get_run_logger().warning("target %s stopped fail-closed (%s); Prefect may retry", target, result.stopped)
        if result.stopped == "key_unavailable":
            raise KeyUnavailable(result.error or f"target {target}: key unavailable", retryable=True)
        raise DatabaseError(result.error or f"target {target}: database error")
    return rotation.target_report(merged)


@task(name="verify", persist_result=False, cache_policy=NO_CACHE)
def verify(run_id: str) -> dict[str, Any]:
    ctx = runtime.context(run_id)
    return rotation.verify(ctx, runtime.results(run_id))


@task(name="retire_gate_report", persist_result=False, cache_policy=NO_CACHE)
def retire_gate_report(run_id: str, report: dict[str, Any]) -> dict[str, Any]:
    """The gate per older key, published with the run report as table and markdown artifacts."""
    ctx = runtime.context(run_id)
    gate = rotation.gate_report(ctx, runtime.results(run_id))
    report = {**report, "gate": gate}
    create_table_artifact(
        key="pinrotate-report",
        table=[{"target": name, **{k: v for k, v in t.items() if k != "failed_rows"}}
               for name, t in report["targets"].items()],
        description=f"pinrotate run {run_id}: per-target counts (no values)",
    )
    create_markdown_artifact(key="pinrotate-gate", markdown=runtime.gate_markdown(report),
                             description=f"pinrotate retire gate after run {run_id}")
    return gate


@flow(name=FLOW_NAME, persist_result=False, log_prints=False,
      task_runner=ThreadPoolTaskRunner(max_workers=MAX_TASK_THREADS))
def pinrotate_rotate(config_path: str | None = None, dry_run: bool = False, targets: list[str] | None = None,
                     tenant: str | None = None, expected_key_version: str | None = None) -> Any:
    """One rotation run. Parameters name things only: no key, value or secret is ever a parameter."""
    configure_stderr_logging()
    settings = load_settings(config_path)
    flow_run_id = str(get_run_context().flow_run.id)  # type: ignore[union-attr]
    ctx = rotation.open_run(settings, target_names=targets or (), dry_run=dry_run,
                            expected_key=expected_key_version, tenant=tenant, run_id=flow_run_id)
    # Pause / tune from the Prefect UI (issue 12): a Variable read between batches.
    ctx.throttle_control = VariableThrottleControl(settings.job.throttle_variable)
    runtime.register(ctx)
    watcher = runtime.watch_cancellation(flow_run_id, ctx.stop)
    try:
        current = read_current_key(flow_run_id)
        report = rotation.RunReport(flow_run_id, current, dry_run)
        with rotation.single_instance(ctx) as got:
            if not got:
                report.skipped = f"another run holds the lock {rotation.LOCK_NAME}"
                log_event("job_skipped", run_id=flow_run_id, reason="single_instance_lock_held")
                runtime.set_last_report(report)
                return report.as_dict()
            _drain_all(ctx, flow_run_id)
        return runtime.finish(flow_run_id, verify, retire_gate_report)
    except TerminationSignal:
        ctx.stop.set()  # SIGTERM reaches the main thread only: tell every drain to stop between batches
        runtime.wait_for_drains(flow_run_id)
        runtime.finish_after_stop(flow_run_id)
        raise
    finally:
        watcher.set()
        runtime.unregister(flow_run_id)


def _drain_all(ctx: rotation.RunContext, run_id: str) -> None:
    """Targets in their configured order, at most max_degree_of_parallelism drain workers at once."""
    budget = ctx.settings.job.max_degree_of_parallelism
    names = [t.name for t in ctx.targets]
    at_once = max(1, min(budget, len(names), MAX_TASK_THREADS))
    workers = max(1, budget // at_once)
    runtime.start_progress(run_id, create_progress_artifact, update_progress_artifact)
    for i in range(0, len(names), at_once):
        wave = names[i:i + at_once]
        futures: list[PrefectFuture[dict[str, Any]]] = [
            drain_target.submit(run_id, name, workers) for name in wave]
        runtime.track(run_id, futures)
        for future in futures:
            future.wait()
        if ctx.stop.is_set():
            break


def run_flow(**kwargs: Any) -> tuple[State[Any] | None, rotation.RunReport | None]:
    """Run the flow in this process (the CLI's `run` and `demo`); returns its state and report."""
    state = pinrotate_rotate(return_state=True, **kwargs)
    return state, runtime.last_report()
