"""Prometheus metrics of one rotation run (contract §7), delivered to a Pushgateway and/or a
node_exporter textfile. Labels carry only target names and error reasons, never a value, key id
or ciphertext; a failure to deliver is a logged warning and never fails the rotation.

Beyond §7: ``<prefix>_last_success_timestamp_seconds`` (set when a run ends without a fail-closed
stop; feeds the "no successful run" alert) and ``<prefix>_current_key_version`` (the current key
when it is an integer version: which key a backlog drains to, for dashboards and the runbook).
"""

from __future__ import annotations

import http.client
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from urllib.parse import unquote, urlsplit

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    push_to_gateway,
    pushadd_to_gateway,
    write_to_textfile,
)
from prometheus_client.exposition import basic_auth_handler, default_handler
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from .config import MetricsSettings
from .config_errors import TARGET_NAME
from .keyring import is_version
from .log import log_event

DEFAULT_PREFIX = "profile_crypto_reencrypt"
ERROR_REASONS = ("key_unavailable", "decrypt_failed", "conflict", "db_error")
THROTTLE_REASONS = ("lag", "load", "locks", "paused")  # why a drain waited between batches (throttle/)
# A run is anything from an empty no-op (~10 ms) to max_run_duration (600 s by default).
RUN_DURATION_BUCKETS_MS = (10.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 2_500.0, 5_000.0, 10_000.0, 30_000.0,
                           60_000.0, 120_000.0, 300_000.0, 600_000.0)
PUSH_TIMEOUT_SECONDS = 10.0
_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")

# A run's counters start at 0 with every run: their ``_created`` series would only say when the
# run started. prometheus_client's own switch; it applies to the whole process.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


class RotationMetrics:
    """The metrics of one run, in a registry of their own (never prometheus_client's global one).

    One instance per run: what is delivered describes that run, and replaces what the previous
    run delivered (the Pushgateway group of ``job``, the textfile), which is what the alert rules
    in ``deploy/alerts.yml`` expect. Only the last success time survives a run that did not
    succeed. Every method is safe to call from drain worker threads.
    """

    def __init__(self, prefix: str = DEFAULT_PREFIX, registry: CollectorRegistry | None = None) -> None:
        if not _PREFIX.fullmatch(prefix):
            raise ValueError("metrics prefix must match [a-zA-Z_:][a-zA-Z0-9_:]*")
        self.prefix = prefix
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._last_success: float | None = None
        self._current_key_version: int | None = None
        self._progress = Gauge(f"{prefix}_progress", "Rows still on an old key, per target (converges to 0).",
                               ["target"], registry=self.registry)
        self._processed = Counter(f"{prefix}_processed_total", "Rows re-encrypted to the current key in this run.",
                                  ["target"], registry=self.registry)
        self._run_duration = Histogram(f"{prefix}_run_duration_ms", "Duration of a rotation run in milliseconds.",
                                       buckets=RUN_DURATION_BUCKETS_MS, registry=self.registry)
        self._errors = Counter(f"{prefix}_errors_total", "Errors in this run, by reason.", ["reason"],
                               registry=self.registry)
        # Pre-initialised so that alert expressions see a series (0) before the first error.
        for reason in ERROR_REASONS:
            self._errors.labels(reason=reason)
        # Sharing the database (throttle/): how long the drains waited, and what they saw last.
        self._throttled = Counter(f"{prefix}_throttled_seconds_total",
                                  "Seconds the drain waited between batches in this run, by reason.", ["reason"],
                                  registry=self.registry)
        for reason in THROTTLE_REASONS:
            self._throttled.labels(reason=reason)
        self._batch_size: int | None = None  # absent until a drain reported one
        self._replica_lag: float | None = None  # absent unless replica lag was measured
        self.registry.register(_RunFacts(self))

    @classmethod
    def from_settings(cls, settings: MetricsSettings) -> RotationMetrics:
        return cls(prefix=settings.prefix)

    def set_progress(self, target: str, rows_left: int) -> None:
        _check_target(target)
        if rows_left < 0:
            raise ValueError("rows_left must be >= 0")
        self._progress.labels(target=target).set(rows_left)

    def add_processed(self, target: str, rows: int) -> None:
        _check_target(target)
        if rows < 0:
            raise ValueError("rows must be >= 0")
        self._processed.labels(target=target).inc(rows)

    def add_error(self, reason: str, count: int = 1) -> None:
        if reason not in ERROR_REASONS:
            raise ValueError(f"unknown error reason; expected one of {', '.join(ERROR_REASONS)}")
        if count < 0:
            raise ValueError("count must be >= 0")
        self._errors.labels(reason=reason).inc(count)

    def observe_run_duration_ms(self, ms: float) -> None:
        if ms < 0:
            raise ValueError("run duration must be >= 0")
        self._run_duration.observe(ms)

    def add_throttled(self, reason: str, seconds: float) -> None:
        if reason not in THROTTLE_REASONS:
            raise ValueError(f"unknown throttle reason; expected one of {', '.join(THROTTLE_REASONS)}")
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        self._throttled.labels(reason=reason).inc(seconds)

    def set_batch_size(self, rows: int) -> None:
        if rows < 0:
            raise ValueError("batch size must be >= 0")
        with self._lock:
            self._batch_size = rows

    def set_replica_lag(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("replica lag must be >= 0")
        with self._lock:
            self._replica_lag = seconds

    def set_current_key(self, key: str) -> None:
        """Export the current key as a number when it is an integer version. A key id (``fpc1``)
        is no number and must not become a label either, so the gauge is withdrawn."""
        with self._lock:
            self._current_key_version = int(key) if is_version(key) else None

    def mark_success(self, when: float | None = None) -> None:
        """Call when the run ended without a fail-closed stop (a no-op run is a success)."""
        with self._lock:
            self._last_success = time.time() if when is None else when

    def deliver(self, settings: MetricsSettings) -> list[str]:
        """Push to ``settings.pushgateway`` (group ``job=settings.job``) and/or write
        ``settings.textfile``. Returns one line per destination; failures start with
        ``warning:``, are logged, and raise nothing. No credential appears in either."""
        if settings.prefix != self.prefix:
            raise ValueError("metrics settings name another prefix than this RotationMetrics")
        done: list[str] = []
        if settings.pushgateway:
            done.append(self._push(settings.pushgateway, settings.job))
        if settings.textfile:
            done.append(self._write_textfile(Path(settings.textfile).expanduser()))
        return done

    def _push(self, gateway: str, job: str) -> str:
        shown = "<unparseable pushgateway url>"
        try:
            url, shown, handler = _pushgateway_endpoint(gateway)
            # A run that succeeded replaces the whole group (PUT), so targets of an earlier run
            # never linger. One that did not replaces only the metrics it has (POST): the group's
            # last success time stays, rather than vanishing and firing the absent() alert.
            push = push_to_gateway if self._has_success() else pushadd_to_gateway
            push(url, job=job, registry=self.registry, timeout=PUSH_TIMEOUT_SECONDS, handler=handler)
        except (OSError, http.client.HTTPException, ValueError) as e:
            log_event("metrics_push_failed", level=logging.WARNING, pushgateway=shown, job=job, error=_error_name(e))
            return f"warning: push to {shown} (job {job}) failed: {_error_name(e)}"
        log_event("metrics_pushed", pushgateway=shown, job=job)
        return f"pushed to {shown} (job {job})"

    def _write_textfile(self, path: Path) -> str:
        try:
            registry = self.registry
            carried = None if self._has_success() else _last_success_in_textfile(path, self.prefix)
            if carried is not None:
                registry = CollectorRegistry(auto_describe=False)
                registry.register(self.registry)
                Gauge(*_last_success_names(self.prefix), registry=registry).set(carried)
            # Temp file + rename in the same folder: node_exporter never reads half a file.
            write_to_textfile(str(path), registry)
        except OSError as e:
            log_event("metrics_textfile_failed", level=logging.WARNING, path=str(path), error=_error_name(e))
            return f"warning: textfile {path} not written: {_error_name(e)}"
        log_event("metrics_textfile_written", path=str(path))
        return f"wrote {path}"

    def _has_success(self) -> bool:
        with self._lock:
            return self._last_success is not None


class _RunFacts(Collector):
    """The last success time and the current key version: absent rather than 0 while unknown (a 0
    timestamp would read as "last success in 1970")."""

    def __init__(self, metrics: RotationMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self._metrics
        with m._lock:
            last_success, key_version = m._last_success, m._current_key_version
            batch_size, replica_lag = m._batch_size, m._replica_lag
        if batch_size is not None:
            yield GaugeMetricFamily(f"{m.prefix}_batch_size", "Batch size the drain used last (adaptive or fixed).",
                                    value=batch_size)
        if replica_lag is not None:
            yield GaugeMetricFamily(f"{m.prefix}_replica_lag_seconds",
                                    "Replay lag of the furthest-behind replica, last measured by the drain.",
                                    value=replica_lag)
        if last_success is not None:
            yield GaugeMetricFamily(*_last_success_names(m.prefix), value=last_success)
        if key_version is not None:
            yield GaugeMetricFamily(f"{m.prefix}_current_key_version",
                                    "The current key version (integer versions only).", value=key_version)


def _last_success_names(prefix: str) -> tuple[str, str]:
    return (f"{prefix}_last_success_timestamp_seconds",
            "Unix time at which the last rotation run ended without a fail-closed stop.")


Handler = Callable[..., Callable[[], None]]


def _pushgateway_endpoint(gateway: str) -> tuple[str, str, Handler]:
    """The URL to push to (credentials taken out), the URL to show (no query either), and the
    handler: basic auth when the URL carried ``user:password@``."""
    parts = urlsplit(gateway if "://" in gateway else f"http://{gateway}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("pushgateway must be an http(s) URL with a host")
    netloc = parts.netloc.rpartition("@")[2]
    parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    url = parts._replace(netloc=netloc).geturl()
    shown = parts._replace(netloc=netloc, query="", fragment="").geturl()
    if parts.username is None:
        return url, shown, default_handler
    return url, shown, partial(basic_auth_handler, username=unquote(parts.username),
                               password=unquote(parts.password or ""))


def _check_target(target: str) -> None:
    # Same rule as a configured target name: nothing else can become a label value.
    if not isinstance(target, str) or not TARGET_NAME.fullmatch(target):
        raise ValueError("target must be a target name ([A-Za-z0-9_.-]{1,64})")


def _last_success_in_textfile(path: Path, prefix: str) -> float | None:
    """The last-success time that a previous run wrote to ``path``, if there is one to read."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # absent or unreadable: this run writes the file without an old time
    return _find_last_success(text, prefix)


def _find_last_success(text: str, prefix: str) -> float | None:
    name = f"{prefix}_last_success_timestamp_seconds"
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
    except ValueError:
        return None  # a damaged exposition holds nothing trustworthy to carry forward
    return None


def _error_name(e: BaseException) -> str:
    """A short, value-free description: the class, plus the HTTP status or errno."""
    status = getattr(e, "code", None)
    if isinstance(status, int):
        return f"{type(e).__name__} {status}"
    errno = getattr(e, "errno", None)
    reason = getattr(e, "reason", None)
    if errno is None and isinstance(reason, BaseException):
        return f"{type(e).__name__} ({type(reason).__name__})"
    return type(e).__name__ if errno is None else f"{type(e).__name__} errno {errno}"
