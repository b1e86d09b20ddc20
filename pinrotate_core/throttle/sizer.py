"""The size of the next batch: fixed, or adapting to recent batch times (pure, thread-safe).

Knows nothing of the database: the throttle feeds it batch times and lock back-offs.
"""

from __future__ import annotations

import math
import threading
from collections import deque


class BatchSizer:
    """The size of the next batch: fixed, or following recent batch times toward a target.

    Adaptive (GitLab's batched background migrations): the size moves by the ratio of the target
    to the time a batch of this size takes by the moving average of the last ``window`` batches
    (per row, so that batches of other sizes count alike), at most +10% / -20% per batch, inside
    ``[minimum, maximum]``. ``halve`` backs off at once (application sessions wait on our locks);
    a fixed size then grows back by 10% per batch to where it was, an adaptive size grows back no
    further than the size at which sessions were blocked (``blocked_at``, the lowest seen this run:
    batch times alone do not show what our locks cost the application). An operator's ``override``
    wins while it is set. Thread-safe: the workers of a drain share one sizer.
    """

    GROW = 1.10
    SHRINK = 0.80
    DEADBAND = 0.05  # within 5% of the target: keep the size

    def __init__(self, batch_size: int, *, target: float | None = None, minimum: int = 50, maximum: int = 5000,
                 window: int = 5) -> None:
        if batch_size <= 0 or minimum <= 0 or maximum < minimum or window <= 0:
            raise ValueError("batch sizes must be > 0 with minimum <= maximum, window > 0")
        if target is not None and target <= 0:
            raise ValueError("batch time target must be > 0")
        self.target = target
        # A fixed size below the adaptive floor stays allowed (and is its own floor).
        self.minimum = min(minimum, batch_size)
        self.maximum = max(maximum, batch_size) if target is None else maximum
        self._ceiling = batch_size if target is None else maximum
        self._size = max(self.minimum, min(batch_size, self.maximum))
        self._times: deque[float] = deque(maxlen=window)
        self._override: int | None = None
        self.blocked_at: int | None = None  # adaptive: the smallest size at which our locks blocked a session
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        with self._lock:
            return self._override if self._override is not None else self._size

    def override(self, size: int | None) -> None:
        """An operator's batch size (None: back to the sizer's own)."""
        if size is not None and size <= 0:
            raise ValueError("batch size override must be > 0")
        with self._lock:
            self._override = size

    def observe(self, seconds: float, rows: int) -> None:
        """One batch of ``rows`` rows took ``seconds`` from locking its rows to its commit."""
        if seconds < 0 or rows < 0:
            raise ValueError("batch time and rows must be >= 0")
        with self._lock:
            self._times.append(seconds / max(rows, 1))
            if self.target is None:
                # Fixed: only recover from a halving, 10% per batch.
                self._size = min(self._ceiling, self._scaled(self.GROW))
                return
            average = self._size * sum(self._times) / len(self._times)  # a batch of the current size
            if abs(average - self.target) <= self.DEADBAND * self.target:
                return
            ratio = self.target / average if average > 0 else self.GROW
            size = self._bounded(self._scaled(min(self.GROW, max(self.SHRINK, ratio))))
            if self.blocked_at is not None and size > self._size:
                size = max(self._size, min(size, self.blocked_at))  # grow no further than where we blocked
            self._size = size

    def halve(self) -> None:
        """Application sessions wait on our locks: back off at once (and, adaptive, remember where)."""
        with self._lock:
            if self.target is not None:
                self.blocked_at = self._size if self.blocked_at is None else min(self.blocked_at, self._size)
            self._size = self._bounded(self._size // 2)
            # Recent times were measured at the old size: start the average afresh.
            self._times.clear()

    def _scaled(self, factor: float) -> int:
        # Rounded toward the old size, so a step never exceeds its bound (but moves by one row at least).
        if factor >= 1:
            return max(self._size + 1, math.floor(self._size * factor))
        return min(self._size - 1, math.ceil(self._size * factor))

    def _bounded(self, size: int) -> int:
        return max(self.minimum, min(self.maximum, size))
