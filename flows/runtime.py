"""What a flow run needs from Prefect and Dask besides its tasks: the task runner chosen in the
configuration, cancellation seen from any process, the progress artifact, and a clean Failed or
Cancelled end.

Nothing here keeps state between calls: every object belongs to one flow run and is passed along.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any
from uuid import UUID

import httpx
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from prefect.states import Cancelling
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from flows.worker_logs import LOCAL_WORKER_ENV, relog, topic
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


# -- cancellation, and an orchestrator that stops answering ---------------------------------------

# What a call to the Prefect API raises when the API cannot be reached or answers with an error
# (httpx.ConnectError is not an OSError; PrefectHTTPStatusError is an httpx.HTTPStatusError).
API_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError, OSError)
# How long the Prefect API may stay unreachable before the run counts it lost: a server restart
# or a network blip is shorter; meanwhile the drains go on with the last control they read.
ORCHESTRATOR_GRACE_S = 30.0
API_BACKOFF_MAX_S = 8.0


API_POLL_TIMEOUT_S = 10.0


@contextlib.contextmanager
def polling_client() -> Iterator[SyncPrefectClient]:
    """A Prefect client for the run's own polls: one attempt per call, bounded in time.

    Prefect's client tries a refused connection six times with backoff (over a minute) and waits
    60 s on a server that does not answer; a poll that fails is simply asked again later, by a
    caller that knows how long the API has been away.
    """
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0, PREFECT_API_REQUEST_TIMEOUT: API_POLL_TIMEOUT_S}), \
            get_client(sync_client=True) as client:
        yield client


class OrchestratorLost(PinrotateError):
    """The Prefect API stopped answering for longer than ``ORCHESTRATOR_GRACE_S``: every drain
    stopped between batches (committed batches stay); the run cannot report to Prefect (exit 4)."""


class _ApiAbsence:
    """Since when this process has found the Prefect API of a run unreachable, and which runs have
    lost it: one record per process, shared by every watch of the run in it (the flow's, each
    shard's), so that the grace counts from the first failure, not from each shard's start.

    While the API is away, Prefect's own clients (its log and event workers) would print a line
    per attempt; they are kept quiet then, as the watch's own lines say it once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}
        self.lost: set[str] = set()

    def failed(self, run_id: str, now: float) -> float:
        """Seconds since the first failure of the current outage."""
        with self._lock:
            since = self._since.setdefault(run_id, now)
            logging.raiseExceptions = False  # Prefect's log worker prints its failures only if set
            return now - since

    def answered(self, run_id: str) -> None:
        with self._lock:
            self._since.pop(run_id, None)
            logging.raiseExceptions = not self._since and not self.lost

    def away(self) -> bool:
        return bool(self._since) or bool(self.lost)


API_ABSENCE = _ApiAbsence()


class _QuietWhileApiAway(logging.Filter):
    """Prefect's own line per failed attempt to reach its API (events, logs), while it is away."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (API_ABSENCE.away() and record.levelno < logging.CRITICAL)


def quiet_prefect_clients_while_api_away() -> None:
    """Install the filter on the loggers of Prefect's background clients (idempotent)."""
    for name in ("prefect.events.clients", "prefect._internal.concurrency", "prefect.events.worker"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietWhileApiAway) for f in logger.filters):
            logger.addFilter(_QuietWhileApiAway())


def orchestrator_lost(run_id: str) -> bool:
    """Has a watch in this process found the run's Prefect API gone for good?"""
    return run_id in API_ABSENCE.lost


@dataclass
class ApiWatch:
    """What a cancellation watch saw of the Prefect API while the block ran."""

    lost: bool = False


@contextlib.contextmanager
def cancellation_watch(flow_run_id: str, stop: threading.Event, every: float = CANCEL_POLL_S,
                       grace: float = ORCHESTRATOR_GRACE_S) -> Iterator[ApiWatch]:
    """While the block runs, poll the flow run's state and set ``stop`` once it is being cancelled.

    Runs in every process that drains (the flow's, each Dask worker's): a cancellation from the UI,
    the API or a SIGTERM to the CLI (which cancels the flow run) reaches every drain this way, and
    each stops between batches. The thread runs in a copy of the caller's context, so that it talks
    to the same Prefect API as the run does.

    An API that does not answer is asked again with backoff while the drains go on; one that stays
    unreachable for ``grace`` seconds is lost: ``stop`` is set and the yielded ``ApiWatch`` says so.
    """
    done = threading.Event()
    seen = ApiWatch()

    def poll() -> None:
        wait = every
        while not done.is_set():
            if orchestrator_lost(flow_run_id):
                seen.lost = True
                stop.set()
                return
            try:
                with polling_client() as client:
                    # At once, then every `every` seconds: a short shard must not miss a cancellation.
                    while not _cancelling(client, flow_run_id):
                        if API_ABSENCE.away() and not orchestrator_lost(flow_run_id):
                            API_ABSENCE.answered(flow_run_id)
                            log_event("prefect_api_reachable", run_id=flow_run_id)
                        wait = every
                        if done.wait(every):
                            return
                log_event("cancel_requested", run_id=flow_run_id)
                stop.set()
                return
            except API_ERRORS as e:
                first = not API_ABSENCE.away()
                away_s = API_ABSENCE.failed(flow_run_id, time.monotonic())
                if first:
                    log_event("prefect_api_unreachable", level=logging.WARNING, run_id=flow_run_id,
                              error=type(e).__name__, gives_up_after_s=grace)
                elif away_s >= grace:
                    if not orchestrator_lost(flow_run_id):
                        API_ABSENCE.lost.add(flow_run_id)
                        log_event("prefect_api_lost", level=logging.ERROR, run_id=flow_run_id,
                                  unreachable_s=round(away_s, 1))
                    continue
                wait = min(wait * 2, API_BACKOFF_MAX_S, max(every, grace - away_s))
            if done.wait(wait):
                return

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(poll,), name=f"cancel-watch-{flow_run_id[:8]}",
                              daemon=True)
    thread.start()
    try:
        yield seen
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
    """Raises one of ``API_ERRORS`` when the API cannot say."""
    try:
        state = client.read_flow_run(UUID(flow_run_id)).state
    except ObjectNotFound:
        return False
    return state is not None and (state.is_cancelling() or state.is_cancelled())


def flow_run_cancelling(flow_run_id: str) -> bool:
    """Is the flow run being cancelled? (Asked once before a task starts: Prefect does not refuse to
    start a task of a cancelling flow run.) An API that cannot say is no: the task's own watch
    keeps asking."""
    try:
        with polling_client() as client:
            return _cancelling(client, flow_run_id)
    except API_ERRORS:
        return False


def cancel_flow_run(flow_run_id: str) -> None:
    """Put the flow run in Cancelling, which every drain of the run sees within about a second."""
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(UUID(flow_run_id), Cancelling(message="stopped by SIGTERM"), force=True)
    except API_ERRORS as e:
        # The drains of this process stop anyway (SIGTERM set their event); others see the API lost.
        log_event("cancel_not_recorded", level=logging.WARNING, run_id=flow_run_id, error=type(e).__name__)


# -- progress ---------------------------------------------------------------------------------------

class RunProgress:
    """One progress artifact for the run: the share of the backlog at the start that has been handled.

    It moves with every batch of any drain (``batch``, from the run's log lines, wherever the drain
    runs) and is set right when a shard ends (``advance``, with what the shard turned out to hold).
    ``batch`` only counts, under a lock; the artifact is written by ``publish`` and ``advance``,
    never while that lock is held.
    """

    def __init__(self, run_id: str, current_key: str, total: int) -> None:
        self.run_id = run_id
        self.unpublished = False  # the last update did not reach the API (logged once)
        self.total = total
        self.done = 0
        self._lock = threading.Lock()
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
            with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0,
                                             PREFECT_API_REQUEST_TIMEOUT: API_POLL_TIMEOUT_S}):
                update_progress_artifact(artifact_id=self.artifact_id, **fields)
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


def quiet_fail_closed_tracebacks() -> None:
    """Install the filter on the loggers of Prefect's flow engine (idempotent)."""
    for name in ("prefect.flow_runs", "prefect.engine", "prefect.flow_engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForFailClosed) for f in logger.filters):
            logger.addFilter(_NoTracebackForFailClosed())

