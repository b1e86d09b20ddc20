"""Traces of a run (contract §7): the OpenTelemetry SDK and its OTLP exporter, set up from the
standard environment, in every process of a run, and only when that environment asks for it.

``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` turns tracing on;
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` picks ``http/protobuf``
(the default) or ``grpc``; ``OTEL_SERVICE_NAME`` (default ``pinrotate``), ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_EXPORTER_OTLP_HEADERS``, timeouts and certificates are read by the SDK as everywhere else.
``OTEL_SDK_DISABLED=true`` turns it off again. Without an endpoint nothing is imported beyond
``opentelemetry-api``, nothing is set up, nothing is exported.

Prefect makes the spans of the flow run (the trace's root) and of its task runs through
``opentelemetry-api``; the core adds ``pinrotate.drain`` and ``pinrotate.batch`` spans beneath
them. Tasks that run in another process (Dask workers) get the run's W3C ``traceparent`` in their
``RunSpec`` and join the trace with it when Prefect's own span context did not come along.

Every process sends what it has before its part of the run returns: a span whose parent lives in
another process (a task run's span, the flow run's root) flushes the exporter when it ends, so a
Dask worker's spans are at the collector before its task's result is, and the CLI flushes again
before it exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pinrotate_core import tracing
from pinrotate_core.errors import ConfigError
from pinrotate_core.log import log_event

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_SERVICE_NAME = "pinrotate"
FLUSH_TIMEOUT_MS = 10_000

_W3C = TraceContextTextMapPropagator()  # traceparent (and tracestate) only: no baggage crosses processes
_lock = threading.Lock()
_provider: TracerProvider | None = None


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """The environment names an OTLP endpoint for traces (and does not disable the SDK)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARS)


def protocol(environ: Mapping[str, str] = os.environ) -> str:
    """The OTLP protocol the environment asks for; ConfigError (exit 2) for one pinrotate lacks."""
    for name in PROTOCOL_VARS:
        value = environ.get(name, "").strip()
        if value:
            if value not in PROTOCOLS:
                raise ConfigError(f"{name}={value!r} is not supported: use http/protobuf (the default) or grpc")
            return value
    return PROTOCOLS[0]


def check_environment(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse, before anything starts, an OTLP environment this run cannot honour."""
    if wanted(environ):
        protocol(environ)


def setup_from_environment() -> bool:
    """Install the SDK's tracer provider with an OTLP exporter when the environment asks for one.
    Idempotent; True when this process exports spans. Never raises for the environment: a run
    refuses a bad one before it starts (``check_environment``); here it is logged and left off."""
    global _provider
    if not wanted():
        return False
    with _lock:
        if _provider is not None:
            return True
        try:
            proto = protocol()
        except ConfigError as e:
            log_event("traces_off", level=logging.WARNING, reason=str(e))
            return False
        # Imported here: a run without tracing never loads the SDK, protobuf or gRPC.
        from flows.traces_export import tracer_provider

        provider = tracer_provider(proto, DEFAULT_SERVICE_NAME, FLUSH_TIMEOUT_MS)
        trace.set_tracer_provider(provider)
        _provider = provider
        return True


def flush() -> None:
    """Send every finished span of this process now (before the process exits); no-op when off."""
    if _provider is not None:
        _provider.force_flush(FLUSH_TIMEOUT_MS)


# -- the run's trace across processes ------------------------------------------------------------

def traceparent() -> str | None:
    """The W3C traceparent of the current span (in the flow: the flow run's), for tasks that run
    elsewhere; None when tracing is off."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return carrier.get("traceparent")


@contextlib.contextmanager
def joined(parent: str | None) -> Iterator[None]:
    """Run the block in the run's trace, ``parent`` being the flow run's traceparent (from the
    RunSpec): as it is when the current span is in that trace already (Prefect's task run span in
    the flow's process), else under ``parent``. In a Dask worker, Prefect 3 starts the task run's
    span in a trace of its own (it takes the task run for its own parent, which has no trace
    context); the drain's spans join the run's trace here instead, and that lone span is not
    exported (flows.traces_export)."""
    if not parent:
        yield
        return
    context = _W3C.extract({"traceparent": parent})
    wanted_trace = trace.get_current_span(context).get_span_context().trace_id
    current = trace.get_current_span().get_span_context()
    if current.is_valid and current.trace_id == wanted_trace:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


# -- the spans of the flow's steps -----------------------------------------------------------------

FAIL_CLOSED_STOPS = ("key_unavailable", "db_error", "key_mismatch", "throttle_critical")


@contextlib.contextmanager
def step_span(name: str, run_id: str, current_key: str | None, **names: str) -> Iterator[Span | None]:
    """A span for one step of the run (``pinrotate.drain``, ``pinrotate.verify``, ``pinrotate.gate``),
    beneath the task run's span; None when tracing is off."""
    attributes: dict[str, str] = {tracing.RUN_ID: run_id, tracing.CURRENT_KEY: current_key or ""}
    attributes.update({f"pinrotate.{k}": v for k, v in names.items()})
    with tracing.span(name, attributes) as span:
        yield span


def drain_ended(span: Span | None, result: Mapping[str, Any]) -> None:
    """A shard's outcome on its span, as counts and a stop reason: a fail-closed stop is the span's
    error kind (never its message)."""
    if span is None:
        return
    for key in ("reencrypted", "batches", "conflicts", "backlog_before", "backlog_remaining"):
        span.set_attribute(f"pinrotate.{key}", int(result.get(key) or 0))
    span.set_attribute("pinrotate.failed", len(result.get("failed") or ()))
    stopped = result.get("stopped")
    if stopped:
        span.set_attribute("pinrotate.stopped", str(stopped))
        if stopped in FAIL_CLOSED_STOPS:
            tracing.set_error(span, "key_unavailable" if stopped == "key_mismatch" else str(stopped))
