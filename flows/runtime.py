"""What a flow run needs from Prefect and Dask besides its tasks: the task runner chosen in the
configuration, the progress artifact, and a clean Failed or Cancelled end (cancellation and the
link to the Prefect API are in flows.api_watch).

Nothing here keeps state between calls: every object belongs to one flow run and is passed along.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Iterator
from typing import Any
from uuid import UUID

from prefect.artifacts import create_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from flows.api_watch import API_ERRORS, orchestrator_lost, polling_client
from flows.worker_logs import LOCAL_WORKER_ENV, relog, topic
from pinrotate_core.config import Settings
from pinrotate_core.errors import PinrotateError
from pinrotate_core.log import LOGGER_NAME, log_event

PROGRESS_KEY = "pinrotate-progress"  # an artifact key, so that `prefect artifact ls` lists it
MAX_THREADS = 64
# dask.config of the workers of a local cluster (set before they start), each measured here on a drain:
LOCAL_WORKER_CONFIG: dict[str, Any] = {
    # Dask's nannies start workers with MALLOC_TRIM_THRESHOLD_=65536, which makes glibc hand memory
    # back to the kernel after almost every batch: a drain in such a worker ran about 25% slower than
    # in a plain process. A drain's memory is flat (about 100 MiB), so keep it.
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": 64 * 1024 * 1024,
    # Dask samples each worker's stacks 100 times a second for its dashboard's profile: with the
    # drain's three threads contending for the GIL, that cost 5-10% of the throughput.
    "distributed.worker.profile.enabled": False,
    # An idle local cluster of two workers kept 0.29 of this machine's two cores busy with its own
    # timers (scheduler, nannies, workers): an event-loop tick every 20 ms in each process, a
    # psutil system monitor every 0.5 s, the nannies' memory monitor every 0.1 s, work stealing
    # every 0.1 s. All of it competes with the drain for the same cores. Slower timers: 0.04 cores.
    # A shard runs for seconds to minutes, so none of them needs to be faster; the memory monitor
    # still stops a worker that outgrows its limit, within 2 s.
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "10s",
    "distributed.worker.memory.monitor-interval": "2s",
    "distributed.scheduler.work-stealing-interval": "1s",
    # No traceback on the terminal when the run closes its cluster (see flows/dask_worker.py).
    "distributed.worker.preload": ["flows.dask_worker"],
    # The workers' own INFO lines (starting, listening at, registered to, waiting to connect: about
    # fifty for a cluster of four) say nothing about the run; warnings and errors still show. Set in
    # the worker processes' environment, which Dask reads when it sets up their logging.
    "distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "warning",
}


# -- the task runner ------------------------------------------------------------------------------

def task_runner(settings: Settings, api_url: str | None) -> TaskRunner[Any]:
    """The runner of the drain tasks: ``[job] task_runner`` = threads (default) or dask.

    Dask: an existing cluster at ``[job] dask_address``, else a local cluster of
    ``max_degree_of_parallelism`` worker processes of one thread each (Python's crypto holds the
    GIL: processes, not threads, use more cores). Local workers are told the Prefect API of this
    run, so that they report to the same server even when it is the temporary one.
    """
    job = settings.job
    if job.task_runner == "threads":
        return ThreadPoolTaskRunner(max_workers=min(job.max_degree_of_parallelism, MAX_THREADS))
    import dask
    from prefect_dask.task_runners import DaskTaskRunner

    # The scheduler's and nannies' INFO lines (workers joining and leaving) would drown the run's own;
    # the workers' own are set in LOCAL_WORKER_CONFIG.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    if job.dask_address:
        return DaskTaskRunner(address=job.dask_address)
    env = {"PREFECT_API_URL": api_url} if api_url else {}
    env[LOCAL_WORKER_ENV] = "1"  # the run's lines reach the terminal through the flow (flows.worker_logs)
    dask.config.set(LOCAL_WORKER_CONFIG)
    return DaskTaskRunner(cluster_kwargs={
        "n_workers": job.max_degree_of_parallelism, "threads_per_worker": 1, "processes": True,
        "dashboard_address": None, "env": env})


def start_workers(runner: TaskRunner[Any]) -> None:
    """Start the runner's local Dask cluster, or connect to the existing one, now: prefect-dask
    does it on the first submit, and the flow calls this while the shards are being planned, so
    that spawning the worker processes and the plan overlap. Threads need nothing."""
    if isinstance(runner, ThreadPoolTaskRunner):
        return
    from prefect_dask.task_runners import DaskTaskRunner

    if isinstance(runner, DaskTaskRunner):
        try:
            _ = runner.client  # the property creates the cluster (or connects) and the client
        except OSError as e:  # refused, timed out, no such host (TimeoutError is an OSError)
            where = f"the Dask scheduler at {runner.address} ([job] dask_address)" if runner.address else \
                "a local Dask cluster"
            raise ClusterUnavailable(f"cannot connect to {where}: {e}") from None


@contextlib.contextmanager
def lines_from_workers(runner: TaskRunner[Any], run_id: str) -> Iterator[None]:
    """While the block runs, the run's log lines from Dask workers are logged in this process too
    (see flows.worker_logs); threads log here already."""
    from prefect_dask.task_runners import DaskTaskRunner

    if not isinstance(runner, DaskTaskRunner):
        yield
        return
    client = runner.client
    client.subscribe_topic(topic(run_id), relog(run_id))  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        client.unsubscribe_topic(topic(run_id))  # type: ignore[no-untyped-call]


def api_url() -> str | None:
    """The Prefect API this process talks to: PREFECT_API_URL when set, else the temporary server."""
    with get_client(sync_client=True) as client:
        return str(client.api_url).rstrip("/") or None


# -- progress ---------------------------------------------------------------------------------------

class RunProgress:
    """One progress artifact for the run: the share of the backlog at the start that has been handled.

    It moves with every batch of any drain (``batch``, from the run's log lines, wherever the drain
    runs) and is set right when a shard ends (``advance``, with what the shard turned out to hold).
    ``batch`` only counts, under a lock; the artifact is written by ``publish`` and ``advance``,
    never while that lock is held, one write at a time, so the last write carries the latest share.
    """

    def __init__(self, run_id: str, current_key: str, total: int) -> None:
        self.run_id = run_id
        self.unpublished = False  # the last update did not reach the API (logged once)
        self.total = total
        self.done = 0
        self._lock = threading.Lock()
        # Serialises the artifact's writes, each with the share read under it: the watch thread's
        # periodic write and a shard's end must never cross, or an older share lands last (CI: the
        # artifact ended at 94.8 % after the 100 % write).
        self._writing = threading.Lock()
        self._batched: dict[str, int] = {}  # per target: rows of batches whose shard has not ended
        self._published: float | None = None
        self.title = f"pinrotate run {run_id}: rows moved to key {current_key}"
        self.operator = ""  # what the operator's throttle Variable says, when it says anything
        created = create_progress_artifact(progress=0.0 if total else 100.0, key=PROGRESS_KEY,
                                           description=self.title)
        self.artifact_id: UUID | None = created if isinstance(created, UUID) else None

    def show_operator(self, control: Any, variable: str) -> None:
        """Show the operator's pause / tuning (the throttle Variable) in the artifact's description."""
        said = control if isinstance(control, dict) else {}
        parts = ["paused" if said.get("paused") else ""]
        parts += [f"{k} {said[k]}" for k in ("batch_size", "delay") if said.get(k) is not None]
        operator = ", ".join(p for p in parts if p)
        if operator == self.operator:
            return
        self.operator = operator
        log_event("throttle_operator", variable=variable, state=operator or "none")
        if self.artifact_id is not None:
            description = f"{self.title}; {variable}: {operator}" if operator else self.title
            with self._writing:
                self._update(progress=self.share, description=description)

    @property
    def share(self) -> float:
        with self._lock:
            handled = self.done + sum(self._batched.values())
            return round(100.0 * min(1.0, handled / self.total), 1) if self.total else 100.0

    def batch(self, target: str, rows: int) -> None:
        """A batch of ``target`` handled ``rows`` rows (its shard has not ended yet)."""
        with self._lock:
            self._batched[target] = self._batched.get(target, 0) + rows

    def advance(self, rows: int, recount: int = 0, target: str | None = None) -> None:
        """A shard of ``target`` ended having handled ``rows``; ``recount``: what it held, counted,
        less its planned backlog. Its batches counted so far are now in ``rows``."""
        with self._lock:
            self.done += rows
            self.total = max(0, self.total + recount)
            if target is not None:
                self._batched[target] = max(0, self._batched.get(target, 0) - rows)
        self.publish(force=True)

    def publish(self, force: bool = False) -> None:
        """Write the share to the artifact, if it changed (called every few seconds while draining)."""
        with self._writing:
            share = self.share
            if self.artifact_id is not None and (force or share != self._published):
                self._published = share
                self._update(progress=share)

    def _update(self, **fields: Any) -> None:
        # The artifact shows the run; it never stops it. An API that does not answer is the
        # cancellation watch's to judge (see cancellation_watch).
        assert self.artifact_id is not None
        if orchestrator_lost(self.run_id):
            return
        try:
            # Prefect's update_progress_artifact would write with the run's own client (its retries).
            # (A field left out is left as it is: a description is sent only when it changes.)
            with polling_client() as client:
                client.update_artifact(artifact_id=self.artifact_id, artifact=ArtifactUpdate(
                    data=fields["progress"], **({"description": fields["description"]} if "description" in fields else {})))
        except API_ERRORS as e:
            if not self.unpublished:
                log_event("progress_not_published", level=logging.WARNING, run_id=self.run_id,
                          error=type(e).__name__)
            self.unpublished = True
        else:
            self.unpublished = False


# -- a clean Failed or Cancelled end ------------------------------------------------------------------

class RunEndedWithReport(PinrotateError):
    """The data of a run's Failed or Cancelled state: an exception (Prefect resolves such a state's
    data into one, and a dict it cannot) whose message is counts and reasons only.

    The report travels with it for the in-process caller (the CLI, the demo); Prefect never
    persists it (the flow does not persist results).
    """

    def __init__(self, summary: str, report: dict[str, Any]) -> None:
        super().__init__(summary)
        self.report = report

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.report))


class RunFailedClosed(RunEndedWithReport):
    """A fail-closed stop: the data of the run's Failed state."""


class RunCancelled(RunEndedWithReport):
    """A cancellation (UI, API, SIGTERM) that stopped every drain between batches: the data of the
    run's Cancelled state."""


class ShardCancelled(RunEndedWithReport):
    """A shard stopped by the run's cancellation (or never started because of it): the data of its
    task run's Cancelled state, its result document riding along for the flow."""


class ClusterUnavailable(PinrotateError):
    """The Dask cluster cannot be reached (``[job] dask_address``) or started: exit code 4, as for a
    database or key provider that cannot be reached; nothing was drained."""


class _NoTracebackForFailClosed(logging.Filter):
    """A fail-closed stop or a cancellation is an outcome, not a crash: Prefect's engine logs every
    Failed or Cancelled flow run that a worker runs as an "unexpected exception" with a traceback.
    For ours it logs the one-line summary instead (a cancellation at INFO: the operator asked for
    it), and for an error pinrotate raised on purpose (a cluster, database or key provider that
    cannot be reached, say) its one-line message."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, RunCancelled):
            record.msg, record.args = "pinrotate run ended Cancelled: %s", (str(exc),)
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        elif isinstance(exc, PinrotateError):
            how = "stopped fail-closed: " if isinstance(exc, RunFailedClosed) else ""
            record.msg, record.args = "pinrotate run ended Failed: %s%s", (how, str(exc))
        else:
            return True
        record.exc_info, record.exc_text = None, None
        return True


class _BatchLinesAtDebug(logging.Filter):
    """On Prefect's API log handler: a run's one line per batch (``batch_processed``) is sent to
    the Prefect UI at DEBUG, so that the run's page shows its milestones at INFO (targets started
    and completed, stops, the report) and the batches only when asked for. The terminal and every
    other handler keep the line as it is (a copy is lowered, not the record)."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "pinrotate_event", None) != "batch_processed" or record.levelno <= logging.DEBUG:
            return True
        lowered = copy.copy(record)
        lowered.levelno, lowered.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        self.handler.emit(lowered)
        return False


def batch_lines_at_debug_in_the_ui() -> None:
    """Install the filter on the Prefect API log handlers of the ``pinrotate`` logger (idempotent;
    called at the start of every flow run, after Prefect has set up its logging)."""
    from prefect.logging.handlers import APILogHandler

    for handler in logging.getLogger(LOGGER_NAME).handlers:
        if isinstance(handler, APILogHandler) and not any(isinstance(f, _BatchLinesAtDebug) for f in handler.filters):
            handler.addFilter(_BatchLinesAtDebug(handler))


class _CancelledShardIsNoError(logging.Filter):
    """Prefect's task engine logs a task run's Cancelled end at ERROR; a shard stopped by the run's
    cancellation (ShardCancelled) is the stop the operator asked for: INFO, as the flow's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "Finished in state Cancelled(" in record.getMessage() \
                and "stopped between batches" in record.getMessage():
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def quiet_fail_closed_tracebacks() -> None:
    """Install the filters on the loggers of Prefect's flow and task engines (idempotent)."""
    for name in ("prefect.flow_runs", "prefect.engine", "prefect.flow_engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForFailClosed) for f in logger.filters):
            logger.addFilter(_NoTracebackForFailClosed())
    tasks = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _CancelledShardIsNoError) for f in tasks.filters):
        tasks.addFilter(_CancelledShardIsNoError())

