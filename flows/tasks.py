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
import logging
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
from prefect.states import Cancelled
from prefect.tasks import Task, exponential_backoff
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_result,
    stop_after_attempt,
    stop_when_event_set,
    wait_exponential_jitter,
)

from flows import reports, traces
from flows.api_watch import cancellation_watch, flow_run_cancelling, orchestrator_lost
from flows.runtime import ShardCancelled
from flows.throttle import VariableThrottleControl
from flows.worker_logs import drain_logging
from pinrotate_core import rotation, tracing
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
from pinrotate_core.errors import ConfigError, DatabaseError, KeyUnavailable, PinrotateError, RefusedToStart
from pinrotate_core.key_checks import STOP_KEY_MISMATCH, KeyIdentityMismatch
from pinrotate_core.log import log_event
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
    traceparent: str | None = None  # W3C traceparent of the flow run's span: tasks elsewhere join its trace


@contextlib.contextmanager
def run_context(spec: RunSpec, target_names: Sequence[str] | None = None, *, workers: int = 1,
                announce: bool = False) -> Iterator[rotation.RunContext]:
    """The run as one task sees it: settings, keyring and targets loaded here, connections of its own.
    Only the run's first start (``announce``: the read_current_key task) may create a ``file``
    keyring that is absent; any other task (a shard on a Dask worker) refuses a missing one.

    Refuses (``RefusedToStart``), before anything is written, when the current key is no longer the
    one the run started with.
    """
    settings = load_settings(spec.config_path)
    names = spec.targets if target_names is None else tuple(target_names)
    engine = make_engine(database_url(settings), pool_size=3 * workers + 1)
    ctx = rotation.open_run(settings, target_names=names, dry_run=spec.dry_run, expected_key=spec.expected_key,
                            tenant=spec.tenant, run_id=spec.run_id, engine=engine, create_keyring=announce)
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


_STOP_ORDER = (STOP_KEY_MISMATCH, STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL, STOP_ORCHESTRATOR_LOST,
               STOP_CANCELLED, STOP_DEADLINE)
# Scheme counts of values a drain leaves where they are: a later attempt over the same range passes
# them again, so attempts take the largest count, not the sum (shards, over disjoint ranges, add up).
_LEFT_IN_PLACE = frozenset({"unknown", "unknown_key", "legacy_left"})
# Every field of DrainResult, each folded by name below: a new field must be added here and to both
# merges (tests/test_reports.py checks that this is the whole list), never summed by its type.
FOLDED_FIELDS = frozenset({
    "target", "current_key", "dry_run", "reencrypted", "failed", "conflicts", "batches", "duration_ms",
    "backlog_before", "backlog_remaining", "stopped", "error", "retryable", "sample_ids", "counts",
    "conflicts_by_tenant", "state_error", "notes"})


def _most_serious(stops: Sequence[str | None]) -> str | None:
    present = [s for s in stops if s]
    return min(present, key=lambda r: _STOP_ORDER.index(r) if r in _STOP_ORDER else -1) if present else None


def _failed_once(parts: Sequence[DrainResult]) -> list[FailedRow]:
    by_id: dict[tuple[str, str], FailedRow] = {}
    for part in parts:
        for row in part.failed:
            by_id.setdefault((row.id, row.reason), row)
    return sorted(by_id.values(), key=lambda row: (natural_id_order(row.id), row.reason))


def _samples(parts: Sequence[DrainResult]) -> list[Any]:
    return list(dict.fromkeys(i for p in parts for i in p.sample_ids))[:SAMPLE_IDS]


def _added(maps: Sequence[dict[str, int]], *, largest: frozenset[str] = frozenset()) -> dict[str, int]:
    total: dict[str, int] = {}
    for m in maps:
        for k, n in m.items():
            total[k] = max(total.get(k, 0), n) if k in largest else total.get(k, 0) + n
    return total


def merge_shards(parts: Sequence[DrainResult]) -> DrainResult:
    """One target's shards (disjoint id ranges) as one result: counts and backlogs add up, failed
    rows and samples are listed once, the most serious stop wins with its own message (never the
    message of a shard that stopped for a lesser reason). ``duration_ms`` is the longest shard's;
    the flow replaces it with the target's elapsed wall time."""
    first = parts[0]
    stopped = _most_serious([p.stopped for p in parts])
    return DrainResult(
        target=first.target, current_key=first.current_key, dry_run=first.dry_run,
        reencrypted=sum(p.reencrypted for p in parts), failed=_failed_once(parts),
        conflicts=sum(p.conflicts for p in parts), batches=sum(p.batches for p in parts),
        duration_ms=max(p.duration_ms for p in parts),
        backlog_before=sum(p.backlog_before for p in parts),
        backlog_remaining=sum(p.backlog_remaining for p in parts),
        stopped=stopped, error=next((p.error for p in parts if p.error and p.stopped == stopped), None),
        retryable=any(p.retryable for p in parts if p.stopped == stopped),
        sample_ids=_samples(parts), counts=_added([p.counts for p in parts]),
        conflicts_by_tenant=_added([p.conflicts_by_tenant for p in parts]),
        state_error=next((p.state_error for p in parts if p.state_error), None),
        notes=list(dict.fromkeys(n for p in parts for n in p.notes)))  # a note every shard made, once


def merge_attempts(attempts: Sequence[DrainResult]) -> DrainResult:
    """Successive attempts at one shard (a retryable stop tried again) as one result: what each
    attempt moved adds up; how the shard ended (stop, message, backlog left) is the last attempt's,
    so a first failure that a retry got past does not fail the run."""
    first, last = attempts[0], attempts[-1]
    # A CONFLICT count that an earlier attempt could not record stays unrecorded: the gate must not
    # trust the table for it. An attempt without conflicts had nothing to record.
    unrecorded = next((a.state_error for a in attempts[:-1] if a.state_error and a.conflicts), None)
    return DrainResult(
        target=first.target, current_key=first.current_key, dry_run=first.dry_run,
        reencrypted=sum(a.reencrypted for a in attempts), failed=_failed_once(attempts),
        conflicts=sum(a.conflicts for a in attempts), batches=sum(a.batches for a in attempts),
        duration_ms=sum(a.duration_ms for a in attempts),
        backlog_before=first.backlog_before, backlog_remaining=last.backlog_remaining,
        stopped=last.stopped, error=last.error, retryable=last.retryable,
        sample_ids=_samples(attempts), counts=_added([a.counts for a in attempts], largest=_LEFT_IN_PLACE),
        conflicts_by_tenant=_added([a.conflicts_by_tenant for a in attempts]),
        state_error=last.state_error or unrecorded,
        notes=list(dict.fromkeys(n for a in attempts for n in a.notes)))  # a note every attempt made, once


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
    with run_context(spec, announce=True) as ctx:
        assert ctx.keyring is not None
        return ctx.keyring.current


@task(name="plan_shards", persist_result=False, cache_policy=NO_CACHE)
def plan_shards(spec: RunSpec, shards_per_target: int) -> list[dict[str, Any]]:
    """The shards of every target, in the configured order: ``{target, shard, id_range, rows, exact}``,
    where ``id_range`` is ``(lo, hi]`` (None: open) and ``rows`` the shard's backlog at the start,
    counted (``exact``) or, for a big table, estimated from a sample of its pages."""
    with run_context(spec) as ctx:
        plan = []
        for t in ctx.targets:
            shards = rotation.plan_shards(ctx, t.name, shards_per_target)
            plan += [{"target": t.name, "shard": f"{i}/{len(shards)}", "id_range": s.id_range, "rows": s.rows,
                      "exact": s.exact} for i, s in enumerate(shards, start=1)]
        return plan


@task(name="drain_shard", task_run_name="drain-{target}-{shard}", persist_result=False, cache_policy=NO_CACHE)
def drain_shard(spec: RunSpec, target: str, shard: str = "1/1", id_range: tuple[Any, Any] | None = None,
                rows: int = 0, exact: bool = True) -> dict[str, Any] | State[Any]:
    """Drain one shard of one target, self-contained; returns its result as a plain dict, or, for a
    shard the run's cancellation stopped, a Cancelled state carrying it (``ShardCancelled``).

    ``rows``: the shard's planned backlog, counted (``exact``) or estimated from a page sample; the
    drain starts from it without counting again (a count of one id range of a table keyed by random
    UUIDs visits nearly every page of it: one per shard would cost more than the plan's one scan).
    A dry run counts an estimated shard's range, since its report is that count less what it would
    move. Either way the backlog left is counted when the shard ends.

    A retryable fail-closed stop (database or key provider outage) is tried again here, with
    backoff, and the attempts' counts add up. A cancellation of the flow run, seen through the
    Prefect API, stops the drain between batches.
    """
    traces.setup_from_environment()  # on a worker of an existing Dask cluster, its first task sets it up
    with drain_logging(spec.run_id), traces.joined(spec.traceparent), \
            traces.step_span(tracing.DRAIN_SPAN, spec.run_id, spec.current_key, target=target, shard=shard) as span:
        doc = _drain_shard(spec, target, shard, id_range, rows, exact)
        traces.drain_ended(span, doc)
    if doc.get("stopped") == STOP_CANCELLED:
        # Prefect shows the stop as it was: a Cancelled task run (the data an exception, as Prefect
        # expects of a Cancelled state; the result document rides along for the flow).
        summary = f"{target} shard {shard} stopped between batches: {doc['reencrypted']} rows re-encrypted"
        return Cancelled(message=summary, data=ShardCancelled(summary, doc))
    return doc


def _drain_shard(spec: RunSpec, target: str, shard: str, id_range: tuple[Any, Any] | None, rows: int,
                 exact: bool) -> dict[str, Any]:
    started_at = time.time()
    stop = threading.Event()
    attempts: list[DrainResult] = []
    if orchestrator_lost(spec.run_id):  # another shard of this process found the Prefect API gone
        return {**result_as_dict(stopped_result(target, spec, PinrotateError("the Prefect API stopped answering"),
                                                STOP_ORCHESTRATOR_LOST, rows)), "shard": shard, "worker": _where(),
                "orchestrator_lost": True}
    if flow_run_cancelling(spec.run_id):
        unstarted = DrainResult(target, spec.current_key or "", stopped=STOP_CANCELLED, dry_run=spec.dry_run,
                                backlog_before=rows, backlog_remaining=rows)
        return {**result_as_dict(unstarted), "shard": shard, "worker": _where(), "started": False}
    restarted = _run_before_by_a_lost_worker()

    def attempt() -> DrainResult:
        try:
            with run_context(spec, [target]) as ctx:
                ctx.stop = stop
                if isinstance(ctx.throttle_control, VariableThrottleControl):
                    # Before the first batch and outside the throttle's lock; later reads run
                    # in the background, and the drain goes on with the last value read.
                    ctx.throttle_control.refresh()
                # The first attempt starts from the planned backlog; a retry counts what is left.
                planned = rows if not attempts and (exact or not spec.dry_run) else None
                result = rotation.drain(ctx, target, workers=1, id_range=id_range or (None, None),
                                        planned_backlog=planned, shard=shard)
        except KeyIdentityMismatch as e:
            # This host's keyring holds other material under a key id (checked in run_context(), before any write).
            result = stopped_result(target, spec, e, STOP_KEY_MISMATCH, rows)
        except (RefusedToStart, ConfigError) as e:  # e.g. no keyring file on this worker's host
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
    merged = merge_attempts(attempts)
    if restarted:
        merged.notes.append(f"shard {shard} ran again after the worker running it was lost: the rows that "
                            "worker re-encrypted stay re-encrypted but are not in these counts")
        log_event("shard_counts_lost", level=logging.WARNING, run_id=spec.run_id, target=target, shard=shard)
    # Where it ran (host:pid), for the per-shard table: names a process, never data. The wall-clock
    # start and end give a sharded target its elapsed time (shards overlap).
    return {**result_as_dict(merged), "shard": shard, "worker": _where(), "started": True,
            "started_at": started_at, "ended_at": time.time(), "orchestrator_lost": api.lost}


def _run_before_by_a_lost_worker() -> bool:
    """True when this task runs in a Dask worker because the worker that ran it before died (Dask
    runs such a task again): what the lost worker committed stays, but its counts died with it.

    Asks the scheduler how often the task was on a worker that died (its ``suspicious`` count). A
    thread of the flow's process is never run twice. If the scheduler cannot be asked (it refuses to
    run code), the shard is taken as a first run and the log says why.
    """
    try:
        from distributed import get_client, get_worker

        key = get_worker().get_current_task()
    except (ImportError, ValueError):
        return False  # not in a Dask worker

    def suspicious(key: Any, dask_scheduler: Any = None) -> int:  # defined here: sent by value, not by module
        task = dask_scheduler.tasks.get(key) if dask_scheduler is not None else None
        return int(task.suspicious) if task is not None else 0

    try:
        return bool(get_client().run_on_scheduler(suspicious, key))  # type: ignore[no-untyped-call]
    except Exception as e:  # noqa: BLE001 - any refusal of the scheduler: we cannot tell, and say so
        log_event("shard_rerun_unknown", level=logging.WARNING, error=type(e).__name__)
        return False


def _where() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@task(name="recount_backlog", persist_result=False, cache_policy=NO_CACHE)
def recount_backlog(spec: RunSpec, names: list[str]) -> dict[str, int]:
    """The backlog left of ``names``, counted in the database now: for targets whose shards could
    not count their own (an outage, a lost worker, shards that never started on an estimate), where
    a sum of the shards' last figures would mislead. A target that cannot be counted is left out
    (and logged): its report keeps the shards' figures, with a note."""
    out: dict[str, int] = {}
    try:
        with run_context(spec, names) as ctx:
            for name in names:
                out[name] = sum(s.rows for s in rotation.plan_shards(ctx, name, 1))
    except (DatabaseError, KeyUnavailable, RefusedToStart) as e:
        log_event("backlog_not_recounted", level=logging.WARNING, run_id=spec.run_id, targets=names, error=str(e))
    return out


@task(name="verify", persist_result=False, cache_policy=NO_CACHE)
def verify(spec: RunSpec, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Re-read a sample of the rows each target's drain committed and decrypt them under the current key."""
    with traces.joined(spec.traceparent), traces.step_span("pinrotate.verify", spec.run_id, spec.current_key), \
            run_context(spec, list(results) or None) as ctx:
        return rotation.verify(ctx, {n: result_from_dict(d) for n, d in results.items()})


@task(name="retire_gate_report", persist_result=False, cache_policy=NO_CACHE)
def retire_gate_report(spec: RunSpec, results: dict[str, dict[str, Any]], report: dict[str, Any],
                       shard_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The gate per older key, published with the run report as table and markdown artifacts."""
    with traces.joined(spec.traceparent), traces.step_span("pinrotate.gate", spec.run_id, spec.current_key), \
            run_context(spec, list(results) or None) as ctx:
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
