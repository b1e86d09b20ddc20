"""Pause, resume and tune a running rotation from the Prefect UI: a Prefect Variable, read between batches.

The Variable (``job.throttle_variable``, default ``pinrotate_throttle``) holds e.g.
``{"paused": true}`` or ``{"batch_size": 500, "delay": 1.0}``; absent or ``{}`` means "no say".
A drain asks for it between batches, under its throttle's lock: so the answer is always the last
value read, at once, and a read older than a few seconds starts one new read in the background.
The HTTP call never runs on the drain's thread; when the Prefect API cannot be reached the last
value read stays in force (and the drain is not stopped for it).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from prefect.exceptions import PrefectException

from flows.api_watch import polling_client
from pinrotate_core.log import log_event

DEFAULT_TTL_SECONDS = 3.0
# Variables this process cannot read right now: "unreadable" is logged once per outage, not once
# per shard (each shard reads through a control of its own).
_UNREADABLE: set[str] = set()
_UNREADABLE_LOCK = threading.Lock()
FIRST_READ_WAIT_S = 5.0  # how long a drain waits, before its first batch, for the first read


class VariableThrottleControl:
    """A ``pinrotate_core.throttle`` control source backed by one Prefect Variable (thread-safe).

    Calling it never waits: it returns the last value read (None before the first read ends) and
    starts a background read when the last one is ``ttl`` seconds old. ``refresh`` reads now and
    waits for it (a bounded time), outside any lock: a drain calls it once before it starts.
    """

    def __init__(self, name: str, *, ttl: float = DEFAULT_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()  # guards the fields below; never held during a read
        self._value: Any = None
        self._read_at: float | None = None  # when the last read started
        self._reader: threading.Thread | None = None

    def __call__(self) -> Any:
        self._start_read(force=False)
        with self._lock:
            return self._value

    def refresh(self, timeout: float = FIRST_READ_WAIT_S) -> Any:
        """Read the Variable now (or join the read under way), waiting at most ``timeout`` seconds."""
        reader = self._start_read(force=True)
        reader.join(timeout)
        with self._lock:
            return self._value

    def wait_for_read(self, timeout: float = FIRST_READ_WAIT_S) -> None:
        """Until the read under way, if any, has ended (at most ``timeout`` seconds)."""
        with self._lock:
            reader = self._reader
        if reader is not None:
            reader.join(timeout)

    def _start_read(self, *, force: bool) -> threading.Thread:
        with self._lock:
            reader = self._reader
            if reader is not None and reader.is_alive():
                return reader
            now = self._clock()
            if reader is not None and not force and self._read_at is not None and now - self._read_at < self.ttl:
                return reader
            self._read_at = now  # also after a failure: do not hammer an API that is down
            # In a copy of the caller's context: the read goes to the Prefect API the run uses.
            reader = threading.Thread(target=contextvars.copy_context().run, args=(self._read_once,),
                                      name=f"pinrotate-variable-{self.name}", daemon=True)
            self._reader = reader
        reader.start()
        return reader

    def _read_once(self) -> None:
        try:
            value = self._read()
        except (httpx.HTTPError, PrefectException, OSError) as e:
            with _UNREADABLE_LOCK:
                was_failing = self.name in _UNREADABLE
                _UNREADABLE.add(self.name)
            if not was_failing:
                log_event("throttle_variable_unreadable", level=logging.WARNING, variable=self.name,
                          error=type(e).__name__)
            return
        with self._lock:
            self._value = value
        with _UNREADABLE_LOCK:
            was_failing = self.name in _UNREADABLE
            _UNREADABLE.discard(self.name)
        if was_failing:
            log_event("throttle_variable_readable", variable=self.name)

    def _read(self) -> Any:
        with polling_client() as client:
            variable = client.read_variable_by_name(self.name)
        return None if variable is None else variable.value
