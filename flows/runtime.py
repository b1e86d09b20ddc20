"""What a flow run needs from Prefect and Dask besides its tasks: the task runner chosen in the
configuration, cancellation seen from any process, the progress artifact, and a clean Failed end.

Nothing here keeps state between calls: every object belongs to one flow run and is passed along.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.states import Cancelling
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from pinrotate_core.config import Settings
from pinrotate_core.errors import PinrotateError
from pinrotate_core.log import log_event

CANCEL_POLL_S = 1.0
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

    # The scheduler's and nannies' INFO lines (workers joining and leaving) would drown the run's own.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    if job.dask_address:
        return DaskTaskRunner(address=job.dask_address)
    env = {"PREFECT_API_URL": api_url} if api_url else {}
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


def api_url() -> str | None:
    """The Prefect API this process talks to: PREFECT_API_URL when set, else the temporary server."""
    with get_client(sync_client=True) as client:
        return str(client.api_url).rstrip("/") or None


# -- cancellation ---------------------------------------------------------------------------------

@contextlib.contextmanager
def cancellation_watch(flow_run_id: str, stop: threading.Event, every: float = CANCEL_POLL_S) -> Iterator[None]:
    """While the block runs, poll the flow run's state and set ``stop`` once it is being cancelled.

    Runs in every process that drains (the flow's, each Dask worker's): a cancellation from the UI,
    the API or a SIGTERM to the CLI (which cancels the flow run) reaches every drain this way, and
    each stops between batches. The thread runs in a copy of the caller's context, so that it talks
    to the same Prefect API as the run does.
    """
    done = threading.Event()

    def poll() -> None:
        try:
            with get_client(sync_client=True) as client:
                # At once, then every `every` seconds: a short shard must not miss a cancellation.
                while not _cancelling(client, flow_run_id):
                    if done.wait(every):
                        return
        except OSError:
            return  # no API at all: nothing can cancel through it; SIGTERM still reaches the flow
        log_event("cancel_requested", run_id=flow_run_id)
        stop.set()

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(poll,), name=f"cancel-watch-{flow_run_id[:8]}",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


@contextlib.contextmanager
def sigterm_cancels(flow_run_id: str, stop: threading.Event) -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM cancels the flow run through the API.

    Prefect's own handler raises TerminationSignal wherever the main thread happens to be (in the
    middle of submitting a task, even inside a serializer that wraps it in another exception); this
    one only sets ``stop`` and cancels the flow run, which every drain of the run, in any process,
    sees within a second and stops between batches. The flow then reports as usual (exit 143).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            return
        stop.set()
        log_event("cancel_requested", run_id=flow_run_id, reason="sigterm")
        # Not in the handler itself: an HTTP call may not run inside whatever the signal interrupted.
        threading.Thread(target=contextvars.copy_context().run, args=(cancel_flow_run, flow_run_id),
                         name="cancel-flow-run", daemon=True).start()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cancelling(client: SyncPrefectClient, flow_run_id: str) -> bool:
    try:
        state = client.read_flow_run(UUID(flow_run_id)).state
    except (PrefectHTTPStatusError, ObjectNotFound, OSError):
        return False  # the API is briefly unreachable: the drain goes on, the next poll tries again
    return state is not None and (state.is_cancelling() or state.is_cancelled())


def flow_run_cancelling(flow_run_id: str) -> bool:
    """Is the flow run being cancelled? (Asked once before a task starts: Prefect does not refuse to
    start a task of a cancelling flow run.)"""
    with get_client(sync_client=True) as client:
        return _cancelling(client, flow_run_id)


def cancel_flow_run(flow_run_id: str) -> None:
    """Put the flow run in Cancelling, which every drain of the run sees within about a second."""
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(flow_run_id), Cancelling(message="stopped by SIGTERM"), force=True)


# -- progress ---------------------------------------------------------------------------------------

class RunProgress:
    """One progress artifact for the run: the share of the backlog at the start that has been handled."""

    def __init__(self, run_id: str, current_key: str, total: int) -> None:
        self.total = total
        self.done = 0
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
            update_progress_artifact(artifact_id=self.artifact_id, progress=self.share, description=description)

    @property
    def share(self) -> float:
        return round(100.0 * min(1.0, self.done / self.total), 1) if self.total else 100.0

    def advance(self, rows: int, recount: int = 0) -> None:
        """``rows`` more handled; ``recount``: what a shard held, counted, less its planned backlog."""
        self.done += rows
        self.total = max(0, self.total + recount)
        if self.artifact_id is not None:
            update_progress_artifact(artifact_id=self.artifact_id, progress=self.share)


# -- a clean Failed end -----------------------------------------------------------------------------

class RunFailedClosed(PinrotateError):
    """The data of a fail-closed run's Failed state: its message is counts and reasons only.

    The report travels with it for the in-process caller (the CLI, the demo); Prefect never
    persists it (the flow does not persist results).
    """

    def __init__(self, summary: str, report: dict[str, Any]) -> None:
        super().__init__(summary)
        self.report = report

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.report))


class ClusterUnavailable(PinrotateError):
    """The Dask cluster cannot be reached (``[job] dask_address``) or started: exit code 4, as for a
    database or key provider that cannot be reached; nothing was drained."""


class _NoTracebackForFailClosed(logging.Filter):
    """A fail-closed stop is an outcome, not a crash: Prefect's engine logs every Failed flow run as
    an "unexpected exception" with a traceback; for ours it logs the one-line summary instead, and
    for an error pinrotate raised on purpose (a cluster, database or key provider that cannot be
    reached, say) its one-line message."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, PinrotateError):
            how = "stopped fail-closed: " if isinstance(exc, RunFailedClosed) else ""
            record.msg, record.args = "pinrotate run ended Failed: %s%s", (how, str(exc))
            record.exc_info, record.exc_text = None, None
        return True


def quiet_fail_closed_tracebacks() -> None:
    """Install the filter on the loggers of Prefect's flow engine (idempotent)."""
    for name in ("prefect.flow_runs", "prefect.engine", "prefect.flow_engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForFailClosed) for f in logger.filters):
            logger.addFilter(_NoTracebackForFailClosed())

