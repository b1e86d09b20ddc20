"""The Prefect tasks of a rotation run, each one self-contained.

A task may run in the flow's process, in a Dask worker process, or on another machine: its
parameters are plain, secret-free values (a ``RunSpec``, a target name, a shard), it loads the
settings, the key provider, the keyring and its own database connections itself, and it returns
plain dicts. Key objects refuse to be pickled; no key, value or ciphertext is ever a parameter,
a result or an artifact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.tasks import Task, exponential_backoff
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_result,
    stop_after_attempt,
    stop_when_event_set,
    wait_exponential_jitter,
)

from flows import reports
from flows.api_watch import cancellation_watch, flow_run_cancelling, orchestrator_lost
from flows.throttle import VariableThrottleControl
from flows.worker_logs import drain_logging
from pinrotate_core import rotation
from pinrotate_core.config import load_settings
from pinrotate_core.db import database_url, make_engine
from pinrotate_core.drain import (
    STOP_CANCELLED,
    STOP_DB_ERROR,
    STOP_DEADLINE,
    STOP_KEY_UNAVAILABLE,
    STOP_ORCHESTRATOR_LOST,
    STOP_THROTTLE_CRITICAL,
    DrainResult,
    natural_id_order,
)
from pinrotate_core.errors import DatabaseError, KeyUnavailable, PinrotateError, RefusedToStart
from pinrotate_core.schemes.base import FailedRow

DRAIN_ATTEMPTS = 4  # a retryable stop (an outage) is tried again with backoff, inside the task
SAMPLE_IDS = 64


@dataclass(frozen=True)
class RunSpec:
    """What every task of one run needs to open the run by itself: names and flags, never a secret."""

    config_path: str | None
    run_id: str
    targets: tuple[str, ...] = ()
    dry_run: bool = False
    tenant: str | None = None
    expected_key: str | None = None  # --expected-key-version, as the operator gave it
    current_key: str | None = None  # the current key read at the start: a task refuses any other
    deadline: float | None = None  # wall clock (time.time()) at which the run leaves the rest for the next one


@contextlib.contextmanager
def opened(spec: RunSpec, target_names: Sequence[str] | None = None, *, workers: int = 1,
           announce: bool = False) -> Iterator[rotation.RunContext]:
    """The run as one task sees it: settings, keyring and targets loaded here, connections of its own.

    Refuses (``RefusedToStart``), before anything is written, when the current key is no longer the
    one the run started with.
    """
    settings = load_settings(spec.config_path)
    names = spec.targets if target_names is None else tuple(target_names)
    engine = make_engine(database_url(settings), pool_size=3 * workers + 1)
    ctx = rotation.open_run(settings, target_names=names, dry_run=spec.dry_run, expected_key=spec.expected_key,
                            tenant=spec.tenant, run_id=spec.run_id, engine=engine)
    if spec.deadline is not None:
        # The deadline is wall-clock time shared by every process; the drain counts in monotonic time.
        ctx.started = time.monotonic() + (spec.deadline - time.time()) - settings.job.max_run_duration
    # Pause / tune from the Prefect UI (issue 12): a Prefect Variable, read between batches.
    ctx.throttle_control = VariableThrottleControl(settings.job.throttle_variable)
    try:
        keyring = rotation.read_current_key(ctx, announce=announce)
        if spec.current_key is not None and keyring.current != spec.current_key:
            raise RefusedToStart(f"the current key changed during the run (from {spec.current_key} to "
                                 f"{keyring.current}); nothing was written")
        rotation.resolve_all(ctx)
        yield ctx
    finally:
        ctx.close()


# -- results as plain dicts -----------------------------------------------------------------------------

def result_as_dict(r: DrainResult) -> dict[str, Any]:
    """A drain result as plain data: it crosses processes (and may cross machines)."""
    d = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
    d["failed"] = [f.as_dict() for f in r.failed]
    d["sample_ids"] = list(r.sample_ids)
    return d


def result_from_dict(d: dict[str, Any]) -> DrainResult:
    known = {f.name for f in dataclasses.fields(DrainResult)}
    values = {k: v for k, v in d.items() if k in known}
    values["failed"] = [FailedRow(f["target"], f["id"], tuple(f["columns"]), f["reason"]) for f in d["failed"]]
    return DrainResult(**values)


_STOP_ORDER = (STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL, STOP_ORCHESTRATOR_LOST, STOP_CANCELLED,
               STOP_DEADLINE)


def merge_results(parts: Sequence[DrainResult]) -> DrainResult:
    """Fold the results of one target's shards (or of retried attempts) into one: counts add up,
    failed rows are listed once, the most serious stop wins, durations overlap (the longest counts)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    merged = dataclasses.replace(first)
    for f in dataclasses.fields(first):
        values = [getattr(p, f.name) for p in parts]
        if f.name in ("target", "current_key", "dry_run"):
            continue
        if f.name == "duration_ms":
            merged.duration_ms = max(values)
        elif f.name == "failed":
            by_id: dict[tuple[str, str], FailedRow] = {}
            for rows in values:
                for row in rows:
                    by_id.setdefault((row.id, row.reason), row)
            merged.failed = sorted(by_id.values(), key=lambda row: (natural_id_order(row.id), row.reason))
        elif f.name == "sample_ids":
            merged.sample_ids = list(dict.fromkeys(i for ids in values for i in ids))[:SAMPLE_IDS]
        elif f.name == "stopped":
            present = [v for v in values if v]
            merged.stopped = min(present, key=lambda r: _STOP_ORDER.index(r) if r in _STOP_ORDER else -1) \
                if present else None
        elif f.name == "retryable":
            merged.retryable = any(values)
        elif isinstance(values[0], bool):
            setattr(merged, f.name, any(values))
        elif isinstance(values[0], int):
            setattr(merged, f.name, sum(values))
        elif isinstance(values[0], dict):
            total: dict[str, int] = {}
            for v in values:
                for k, n in v.items():
                    total[k] = total.get(k, 0) + n
            setattr(merged, f.name, total)
        else:  # an optional message (error, state_error): the first one
            setattr(merged, f.name, next((v for v in values if v), None))
    return merged


def stopped_result(target: str, spec: RunSpec, exc: BaseException, stopped: str, rows: int = 0) -> DrainResult:
    """A shard that could not drain at all: fail closed, its rows left for the next run."""
    return DrainResult(target, spec.current_key or "", stopped=stopped, error=str(exc),
                       retryable=bool(getattr(exc, "retryable", isinstance(exc, DatabaseError))),
                       dry_run=spec.dry_run, backlog_before=rows, backlog_remaining=rows)


# -- the tasks --------------------------------------------------------------------------------------------

def _retryable(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry only what trying again can fix: an outage, a timeout, a sealed Vault; never a 403."""
    try:
        state.result(raise_on_failure=True)
    except (KeyUnavailable, DatabaseError) as e:
        return bool(getattr(e, "retryable", True))
    except BaseException:  # noqa: BLE001 - anything else is not ours to retry
        return False
    return False


@task(name="read_current_key", retries=4, retry_delay_seconds=exponential_backoff(backoff_factor=2),
      retry_jitter_factor=0.3, retry_condition_fn=_retryable, persist_result=False, cache_policy=NO_CACHE)
def read_current_key(spec: RunSpec) -> str:
    """Read the keyring and check every start condition; returns the current key id only (never material)."""
    with opened(spec, announce=True) as ctx:
        assert ctx.keyring is not None
        return ctx.keyring.current


@task(name="plan_shards", persist_result=False, cache_policy=NO_CACHE)
def plan_shards(spec: RunSpec, shards_per_target: int) -> list[dict[str, Any]]:
    """The shards of every target, in the configured order: ``{target, shard, id_range, rows, exact}``,
    where ``id_range`` is ``(lo, hi]`` (None: open) and ``rows`` the shard's backlog at the start,
    counted (``exact``) or, for a big table, estimated from a sample of its pages."""
    with opened(spec) as ctx:
        plan = []
        for t in ctx.targets:
            shards = rotation.plan_shards(ctx, t.name, shards_per_target)
            plan += [{"target": t.name, "shard": f"{i}/{len(shards)}", "id_range": s.id_range, "rows": s.rows,
                      "exact": s.exact} for i, s in enumerate(shards, start=1)]
        return plan


@task(name="drain_shard", task_run_name="drain-{target}-{shard}", persist_result=False, cache_policy=NO_CACHE)
def drain_shard(spec: RunSpec, target: str, shard: str = "1/1", id_range: tuple[Any, Any] | None = None,
                rows: int = 0, exact: bool = True) -> dict[str, Any]:
    """Drain one shard of one target, self-contained; returns its result as a plain dict.

    ``rows``: the shard's planned backlog, counted (``exact``) or estimated from a page sample; the
    drain starts from it without counting again (a count of one id range of a table keyed by random
    UUIDs visits nearly every page of it: one per shard would cost more than the plan's one scan).
    A dry run counts an estimated shard's range, since its report is that count less what it would
    move. Either way the backlog left is counted when the shard ends.

    A retryable fail-closed stop (database or key provider outage) is tried again here, with
    backoff, and the attempts' counts add up. A cancellation of the flow run, seen through the
    Prefect API, stops the drain between batches.
    """
    with drain_logging(spec.run_id):
        return _drain_shard(spec, target, shard, id_range, rows, exact)


def _drain_shard(spec: RunSpec, target: str, shard: str, id_range: tuple[Any, Any] | None, rows: int,
                 exact: bool) -> dict[str, Any]:
    stop = threading.Event()
    attempts: list[DrainResult] = []
    if orchestrator_lost(spec.run_id):  # another shard of this process found the Prefect API gone
        return {**result_as_dict(stopped_result(target, spec, PinrotateError("the Prefect API stopped answering"),
                                                STOP_ORCHESTRATOR_LOST, rows)), "shard": shard, "worker": _where(),
                "orchestrator_lost": True}
    if flow_run_cancelling(spec.run_id):
        return {**result_as_dict(stopped_result(target, spec, PinrotateError("cancelled before it started"),
                                                STOP_CANCELLED, rows)), "shard": shard, "worker": _where()}

    def attempt() -> DrainResult:
        try:
            with opened(spec, [target]) as ctx:
                ctx.stop = stop
                if isinstance(ctx.throttle_control, VariableThrottleControl):
                    # Before the first batch and outside the throttle's lock; later reads run
                    # in the background, and the drain goes on with the last value read.
                    ctx.throttle_control.refresh()
                # The first attempt starts from the planned backlog; a retry counts what is left.
                planned = rows if not attempts and (exact or not spec.dry_run) else None
                result = rotation.drain(ctx, target, workers=1, id_range=id_range or (None, None),
                                        planned_backlog=planned)
        except RefusedToStart as e:
            result = stopped_result(target, spec, e, STOP_KEY_UNAVAILABLE, rows)
        except KeyUnavailable as e:
            result = stopped_result(target, spec, e, STOP_KEY_UNAVAILABLE, rows)
        except DatabaseError as e:
            result = stopped_result(target, spec, e, STOP_DB_ERROR, rows)
        attempts.append(result)
        return result

    def worth_retrying(r: DrainResult) -> bool:
        return r.stopped in (STOP_KEY_UNAVAILABLE, STOP_DB_ERROR) and r.retryable and not stop.is_set()

    def before_sleep(state: RetryCallState) -> None:
        get_run_logger().warning("%s shard %s stopped fail-closed; trying again (attempt %d of %d)",
                                 target, shard, state.attempt_number + 1, DRAIN_ATTEMPTS)

    def pause(seconds: float) -> None:
        stop.wait(seconds)  # a cancellation ends the pause at once

    with cancellation_watch(spec.run_id, stop) as api:
        retrying = Retrying(stop=stop_after_attempt(DRAIN_ATTEMPTS) | stop_when_event_set(stop),
                            wait=wait_exponential_jitter(multiplier=2, max=30), retry=retry_if_result(worth_retrying),
                            sleep=pause, before_sleep=before_sleep, retry_error_callback=lambda s: None)
        retrying(attempt)
    merged = merge_results(attempts)
    if len(attempts) > 1:
        # Rows an earlier attempt moved were counted there; the backlog is what the last attempt saw.
        merged.backlog_before = attempts[0].backlog_before
        merged.backlog_remaining = attempts[-1].backlog_remaining
    # Where it ran (host:pid), for the per-shard table: names a process, never data.
    return {**result_as_dict(merged), "shard": shard, "worker": _where(), "orchestrator_lost": api.lost}


def _where() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@task(name="verify", persist_result=False, cache_policy=NO_CACHE)
def verify(spec: RunSpec, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Re-read a sample of the rows each target's drain committed and decrypt them under the current key."""
    with opened(spec, list(results) or None) as ctx:
        return rotation.verify(ctx, {n: result_from_dict(d) for n, d in results.items()})


@task(name="retire_gate_report", persist_result=False, cache_policy=NO_CACHE)
def retire_gate_report(spec: RunSpec, results: dict[str, dict[str, Any]], report: dict[str, Any],
                       shard_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The gate per older key, published with the run report as table and markdown artifacts."""
    with opened(spec, list(results) or None) as ctx:
        gate = rotation.gate_report(ctx, {n: result_from_dict(d) for n, d in results.items()})
    report = {**report, "gate": gate}
    table: list[dict[str, Any]] = []
    for name, t in report["targets"].items():
        # Each target's shards, then its total (the last row of a target is its total).
        table += [row for row in shard_rows if row["target"] == name]
        table.append({"target": name, "shard": "total", **{k: v for k, v in t.items() if k != "failed_rows"}})
    create_table_artifact(key="pinrotate-report", table=table,
                          description=f"pinrotate run {spec.run_id}: per-target and per-shard counts (no values)")
    create_markdown_artifact(key="pinrotate-gate", markdown=reports.gate_markdown(report),
                             description=f"pinrotate retire gate after run {spec.run_id}")
    return gate
