"""Pause, resume and tune a running rotation from the Prefect UI: a Prefect Variable, read between batches.

The Variable (``job.throttle_variable``, default ``pinrotate_throttle``) holds e.g.
``{"paused": true}`` or ``{"batch_size": 500, "delay": 1.0}``; absent or ``{}`` means "no say".
Its value is cached a few seconds so that many batches cost one API call; when the Prefect API
cannot be reached the last value read stays in force (and the drain is not stopped for it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx
from prefect.client.orchestration import get_client
from prefect.exceptions import PrefectException

from pinrotate_core.log import log_event

DEFAULT_TTL_SECONDS = 3.0


class VariableThrottleControl:
    """A ``pinrotate_core.throttle`` control source backed by one Prefect Variable (thread-safe)."""

    def __init__(self, name: str, *, ttl: float = DEFAULT_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._value: Mapping[str, Any] | Any | None = None
        self._read_at: float | None = None
        self._failing = False

    def __call__(self) -> Any:
        with self._lock:
            now = self._clock()
            if self._read_at is not None and now - self._read_at < self.ttl:
                return self._value
            self._read_at = now  # also after a failure: do not hammer an API that is down
            try:
                self._value = self._read()
            except (httpx.HTTPError, PrefectException, OSError) as e:
                if not self._failing:
                    log_event("throttle_variable_unreadable", level=logging.WARNING, variable=self.name,
                              error=type(e).__name__)
                self._failing = True
                return self._value
            if self._failing:
                log_event("throttle_variable_readable", variable=self.name)
                self._failing = False
            return self._value

    def _read(self) -> Any:
        # The sync client explicitly: the drain calls this from its worker threads.
        with get_client(sync_client=True) as client:
            variable = client.read_variable_by_name(self.name)
        return None if variable is None else variable.value
