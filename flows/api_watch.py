"""The flow run's link to its Prefect API, from every process that drains: cancellation seen
within about a second, SIGTERM turned into a cancellation, and an API that stops answering
(retried with backoff, then counted lost: every drain stops between batches, exit 4).

One record per process (``API_ABSENCE``) of how long the run's API has been away, shared by
every watch in it; nothing else is kept between calls.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.context import SettingsContext, SyncClientContext, get_settings_context
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_CLIENT_MAX_RETRIES, Settings
from prefect.states import Cancelling

from pinrotate_core.errors import PinrotateError
from pinrotate_core.log import log_event

CANCEL_POLL_S = 1.0

# -- cancellation, and an orchestrator that stops answering ---------------------------------------

# What a call to the Prefect API raises when the API cannot be reached or answers with an error
# (httpx.ConnectError is not an OSError; PrefectHTTPStatusError is an httpx.HTTPStatusError).
API_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError, OSError)
# How long the Prefect API may stay unreachable before the run counts it lost: a server restart
# or a network blip is shorter; meanwhile the drains go on with the last control they read.
ORCHESTRATOR_GRACE_S = 30.0
API_BACKOFF_MAX_S = 8.0


API_POLL_TIMEOUT_S = 10.0


_BOUNDED: dict[tuple[int, int, float], tuple[Settings, Settings]] = {}
_BOUNDED_LOCK = threading.Lock()


@contextlib.contextmanager
def bounded_settings(max_retries: int, timeout_s: float) -> Iterator[Settings]:
    """Prefect's ``temporary_settings`` with the client's retries and request timeout, its copy of
    the settings made once per process and base settings: Prefect copies them by reading the
    environment again, 0.3 s of CPU each time, which a progress update or a poll every second or
    two would pay each time."""
    context = get_settings_context()
    key = (id(context.settings), max_retries, timeout_s)
    with _BOUNDED_LOCK:
        cached = _BOUNDED.get(key)
        if cached is None or cached[0] is not context.settings:  # an id reused by another object
            bounded = context.settings.copy_with_update(
                updates={PREFECT_CLIENT_MAX_RETRIES: max_retries, PREFECT_API_REQUEST_TIMEOUT: timeout_s})
            cached = _BOUNDED[key] = (context.settings, bounded)
    with SettingsContext(profile=context.profile, settings=cached[1]):
        yield cached[1]


@contextlib.contextmanager
def polling_client() -> Iterator[SyncPrefectClient]:
    """A Prefect client for the run's own polls: one attempt per call, bounded in time.

    Prefect's client tries a refused connection six times with backoff (over a minute) and waits
    60 s on a server that does not answer; a poll that fails is simply asked again later, by a
    caller that knows how long the API has been away.
    """
    with bounded_settings(0, API_POLL_TIMEOUT_S), own_client() as client:
        yield client


@contextlib.contextmanager
def own_client() -> Iterator[SyncPrefectClient]:
    """A Prefect client of this call's own, made with the settings in force here.

    Inside a flow or task run, ``get_client`` hands out the run's own client (its
    ``SyncClientContext``): a watch thread running in a copy of that context then polled with the
    run's retries and timeouts, not its own, and once the task had closed that client a poll
    entering it raised "cannot be started again after closing" and ended the watch (seen on a Dask
    worker). The context's client is hidden while this one is made."""
    token = SyncClientContext.__var__.set(None)  # type: ignore[arg-type]
    try:
        client = get_client(sync_client=True)
    finally:
        SyncClientContext.__var__.reset(token)
    with client:
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


class _StopSignals:
    """The stop signals this process received (one record per process): the first one (SIGTERM or
    SIGINT) stops the run between batches and decides its exit code (143 or 130); a Ctrl-C after it
    stops the process at once, through ``at_once`` (set by the CLI: one line, its temporary server
    stopped, exit 130). Without ``at_once`` (a worker's process) the second Ctrl-C is Python's own
    KeyboardInterrupt. Either way the open batch rolls back with its connection; nothing committed
    is lost."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.at_once: Callable[[], None] | None = None
        # Set by the flow while its drains are submitted: keeps the shards not started yet from
        # starting (a task that starts after the second Ctrl-C's mark would stay Running in Prefect).
        self.hold_back: Callable[[], None] | None = None

    def interrupted(self) -> bool:
        """Was the first stop a Ctrl-C (exit 130 rather than 143)?"""
        return self.first == signal.SIGINT


STOP_SIGNALS = _StopSignals()


@contextlib.contextmanager
def signals_cancel(flow_run_id: str, stop: threading.Event) -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM or SIGINT cancels the flow run through the API.

    Prefect's own handler raises TerminationSignal wherever the main thread happens to be (in the
    middle of submitting a task, even inside a serializer that wraps it in another exception), and
    a Ctrl-C is a KeyboardInterrupt there, which crashes the flow run while its shards drain on;
    this one only sets ``stop`` and cancels the flow run, which every drain of the run, in any
    process, sees within a second and stops between batches. The flow then reports as usual (exit
    143, or 130 for a Ctrl-C) and ends Cancelled. A second Ctrl-C stops at once (``STOP_SIGNALS``).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if STOP_SIGNALS.first is not None:
            if signum == signal.SIGINT:
                stop_at_once(flow_run_id)
            return
        STOP_SIGNALS.first = signum
        already = stop.is_set()
        stop.set()
        log_event("cancel_requested", run_id=flow_run_id, reason=signal.Signals(signum).name.lower())
        if signum == signal.SIGINT:
            log_event("stopping", run_id=flow_run_id,
                      hint="stopping between batches; press Ctrl-C again to stop at once (the open batch "
                           "rolls back)")
        if not already:
            # Not in the handler itself: an HTTP call may not run inside whatever the signal interrupted.
            threading.Thread(target=contextvars.copy_context().run,
                             args=(cancel_flow_run, flow_run_id, signal.Signals(signum).name),
                             name="cancel-flow-run", daemon=True).start()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_at_once(flow_run_id: str | None) -> None:
    """A second Ctrl-C: record the flow run Cancelled if the API answers within a few seconds,
    then end the process (the CLI's ``at_once``), or raise KeyboardInterrupt where there is none."""
    if flow_run_id is not None:
        marker = threading.Thread(target=contextvars.copy_context().run, args=(_hold_back_and_mark, flow_run_id),
                                  name="cancelled-at-once", daemon=True)
        marker.start()
        marker.join(timeout=_MARK_S + 1.0)
    if STOP_SIGNALS.at_once is not None:
        STOP_SIGNALS.at_once()
    raise KeyboardInterrupt


AT_ONCE_MESSAGE = "stopped at once by a second Ctrl-C; the open batch rolled back"
_MARK_S = 4.0  # the mark's reads end by then (a second Ctrl-C waits a second more at most)
_MARK_EVENTS_S = 2.0  # sending this process's own events first
_MARK_PAUSE_S = 0.25
_MARK_EMPTY_READS = 2  # consecutive reads that find no open task run end the mark early


def _hold_back_and_mark(flow_run_id: str) -> None:
    """First no shard starts any more (``STOP_SIGNALS.hold_back``; off the signal handler, which may
    have interrupted the main thread inside a future's lock), then the mark (``_mark_cancelled``)."""
    if STOP_SIGNALS.hold_back is not None:
        try:
            STOP_SIGNALS.hold_back()
        except Exception as e:  # noqa: BLE001 - the process ends at once either way; the mark still runs
            log_event("hold_back_failed", level=logging.WARNING, run_id=flow_run_id, error=type(e).__name__)
    _mark_cancelled(flow_run_id)


def _mark_cancelled(flow_run_id: str) -> None:
    """The flow run and every task run of it not yet final (the drains this process is about to end,
    the shards never started) Cancelled: the process ends before their own engines could say so, and
    Prefect would otherwise show them Running for ever.

    A task run's states reach the API as events, recorded by the server after they arrive: a drain
    that started just before the second Ctrl-C may not be listed yet, and its Running would be
    recorded after this mark (seen in CI: one drain left Running). So this process's events are
    sent first (``EventsWorker.drain_all``, given up to two seconds: on a loaded machine one second
    was not always enough, and the Running sent after the mark won), and the open task runs are
    read again until two reads in a row find none, or the mark's time is up."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.events.worker import EventsWorker
    from prefect.states import Cancelled

    open_states = [StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED, StateType.PAUSED,
                   StateType.CANCELLING]
    with contextlib.suppress(*API_ERRORS), \
            bounded_settings(0, 2.0), own_client() as client:
        deadline = time.monotonic() + _MARK_S
        client.set_flow_run_state(UUID(flow_run_id), Cancelled(message=AT_ONCE_MESSAGE), force=True)
        EventsWorker.drain_all(timeout=_MARK_EVENTS_S)
        empty = 0
        while True:
            task_runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)])),
                task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=open_states))))
            for task_run in task_runs:
                client.set_task_run_state(task_run.id, Cancelled(message=AT_ONCE_MESSAGE), force=True)
            empty = 0 if task_runs else empty + 1
            if empty >= _MARK_EMPTY_READS or time.monotonic() >= deadline:
                break
            time.sleep(_MARK_PAUSE_S)  # the server records the events sent above


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


def cancel_flow_run(flow_run_id: str, by: str = "SIGTERM") -> None:
    """Put the flow run in Cancelling, which every drain of the run sees within about a second."""
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(UUID(flow_run_id), Cancelling(message=f"stopped by {by}"), force=True)
    except API_ERRORS as e:
        # The drains of this process stop anyway (the signal set their event); others see the API lost.
        log_event("cancel_not_recorded", level=logging.WARNING, run_id=flow_run_id, error=type(e).__name__)
