"""A run's log lines and batch progress, wherever its drains run, in the flow's own process.

A drain in a Dask worker logs in that worker's process: on a cluster of other machines
(``dask_address``) nobody running the CLI would see it, and the progress artifact would move only
when a whole shard ends. So every ``pinrotate`` line a drain logs in a Dask worker is also sent to
the scheduler as an event of the run's topic (distributed's ``Worker.log_event``); the flow
subscribes to the topic and logs each line again in its own process, where it reaches the
terminal, the Prefect run logs and the progress artifact as a drain on a thread of the flow does.
Log lines only: names and counts, never a value (``pinrotate_core.log`` refuses bytes).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID

from pinrotate_core.log import LOGGER_NAME, configure_stderr_logging

TOPIC_PREFIX = "pinrotate-log-"
# Set in the environment of the workers of a run's own local cluster: their stderr is the
# terminal the CLI already prints the forwarded lines to, so they do not print them twice.
LOCAL_WORKER_ENV = "PINROTATE_LOCAL_DASK_WORKER"
_PLAIN = (str, int, float, bool, type(None))


def topic(run_id: str) -> str:
    return TOPIC_PREFIX + run_id


class _ToFlow(logging.Handler):
    """In a Dask worker: each ``pinrotate`` record of a run this process drains for, to the run's topic."""

    def __init__(self, worker: Any) -> None:
        super().__init__(logging.INFO)
        self.worker = worker
        self.runs: dict[str, int] = {}  # run id -> drains of it running in this process
        self.runs_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "pinrotate_fields", None) or {}
        with self.runs_lock:
            run_id = fields.get("run_id")
            if run_id not in self.runs:
                # A line without a run id (the keyring loaded, say) belongs to the one run here, if one.
                run_id = next(iter(self.runs)) if len(self.runs) == 1 and run_id is None else None
        if run_id is None:
            return
        msg = {"created": record.created, "level": record.levelno, "message": record.getMessage(),
               "event": getattr(record, "pinrotate_event", None),
               "fields": {k: v for k, v in fields.items() if isinstance(v, _PLAIN)}}
        try:
            self.worker.log_event(topic(str(run_id)), msg)
        except (TypeError, RuntimeError, OSError):  # a worker closing: the line stays in its own log
            self.handleError(record)


_forwarder: _ToFlow | None = None
_forwarder_lock = threading.Lock()


def _dask_worker() -> Any | None:
    try:
        from distributed import get_worker
    except ImportError:
        return None
    try:
        return get_worker()
    except ValueError:  # not in a Dask worker
        return None


@contextlib.contextmanager
def drain_logging(run_id: str) -> Iterator[None]:
    """The log set-up of a drain task: stderr as usual, and in a Dask worker the run's lines also
    to the flow (a worker of the run's own local cluster leaves stderr to the flow)."""
    global _forwarder
    worker = _dask_worker()
    if worker is None:
        configure_stderr_logging()
        yield
        return
    logger = logging.getLogger(LOGGER_NAME)
    if os.environ.get(LOCAL_WORKER_ENV):
        logger.setLevel(logging.INFO)
        logger.propagate = False
    else:
        configure_stderr_logging()
    with _forwarder_lock:
        if _forwarder is None or _forwarder.worker is not worker:
            if _forwarder is not None:
                logger.removeHandler(_forwarder)
            _forwarder = _ToFlow(worker)
            logger.addHandler(_forwarder)
        forwarder = _forwarder
    with forwarder.runs_lock:
        forwarder.runs[run_id] = forwarder.runs.get(run_id, 0) + 1
    try:
        yield
    finally:
        with forwarder.runs_lock:
            forwarder.runs[run_id] -= 1
            if not forwarder.runs[run_id]:
                del forwarder.runs[run_id]


def relog(run_id: str) -> Callable[[tuple[float, Any]], None]:
    """A ``Client.subscribe_topic`` handler: each line a worker sent, logged again in this process
    (with its time, level and fields, and the flow run's id for the Prefect log handler)."""
    logger = logging.getLogger(LOGGER_NAME)
    flow_run_id = UUID(run_id)

    def handle(event: tuple[float, Any]) -> None:
        _, msg = event
        if not isinstance(msg, dict) or not logger.isEnabledFor(int(msg.get("level", logging.INFO))):
            return
        record = logging.makeLogRecord({
            "name": LOGGER_NAME, "levelno": int(msg["level"]), "levelname": logging.getLevelName(int(msg["level"])),
            "msg": str(msg["message"]), "args": None, "created": float(msg["created"]),
            "pinrotate_event": msg.get("event"), "pinrotate_fields": dict(msg.get("fields") or {}),
            "flow_run_id": flow_run_id, "pinrotate_forwarded": True})
        record.msecs = (record.created - int(record.created)) * 1000
        logger.handle(record)

    return handle


class BatchProgress(logging.Handler):
    """In the flow's process: each ``batch_processed`` line of the run (logged by a drain thread of
    this process, or forwarded from a Dask worker) handed to ``on_batch(target, rows handled)``."""

    def __init__(self, run_id: str, on_batch: Callable[[str, int], None]) -> None:
        super().__init__(logging.INFO)
        self.run_id = run_id
        self.on_batch = on_batch

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "pinrotate_event", None) != "batch_processed":
            return
        fields = getattr(record, "pinrotate_fields", None) or {}
        if str(fields.get("run_id")) != self.run_id:
            return
        self.on_batch(str(fields.get("target")), int(fields.get("reencrypted") or 0) + int(fields.get("failed") or 0))


@contextlib.contextmanager
def batch_progress(run_id: str, on_batch: Callable[[str, int], None]) -> Iterator[None]:
    logger = logging.getLogger(LOGGER_NAME)
    handler = BatchProgress(run_id, on_batch)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
