"""The OpenTelemetry SDK side of ``flows.traces``: the tracer provider and its OTLP exporter.

Imported only when the environment turns tracing on, so that a run without it never loads the
SDK, protobuf or gRPC.
"""

from __future__ import annotations

import os

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter


def tracer_provider(protocol: str, default_service_name: str, flush_timeout_ms: int) -> TracerProvider:
    """A provider exporting over OTLP with ``protocol`` (endpoint, headers, timeouts, certificates:
    the exporter reads the standard variables), its resource from ``OTEL_RESOURCE_ATTRIBUTES`` and
    ``OTEL_SERVICE_NAME``, ``default_service_name`` when neither names the service. It shuts down,
    flushing, when the process exits."""
    # The process id tells the flow's process from a Dask worker's (a number, not data).
    resource = Resource.create({"process.pid": os.getpid()})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(FlushAtProcessEdge(BatchSpanProcessor(_exporter(protocol)), flush_timeout_ms))
    return provider


def _exporter(protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


class FlushAtProcessEdge(SpanProcessor):
    """A batch processor that also flushes when a span ends whose parent is in another process, or
    that has none: the end of this process's part of the run (a task run in a Dask worker, whose
    spans must reach the collector before its result reaches the flow; the flow run itself). A
    Prefect task run's span that is the root of a trace of its own is not exported."""

    def __init__(self, inner: BatchSpanProcessor, flush_timeout_ms: int) -> None:
        self._inner = inner
        self._timeout_ms = flush_timeout_ms

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if not _lone_task_run(span):
            self._inner.on_end(span)
        if span.parent is None or span.parent.is_remote:
            self._inner.force_flush(self._timeout_ms)


def _lone_task_run(span: ReadableSpan) -> bool:
    """A Prefect task run's span that started a trace of its own: in a Dask worker, Prefect 3 takes
    the task run for its own parent, which carries no trace context, so the span is the root of a
    one-span trace beside the run's. Left out: the task's ``pinrotate.*`` spans join the run's trace
    through the RunSpec's traceparent (flows.traces.joined), so the run stays one trace."""
    return span.parent is None and (span.attributes or {}).get("prefect.run.type") == "task"

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)
