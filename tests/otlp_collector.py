"""A real OTLP/HTTP trace collector for tests: an HTTP server on a free port of 127.0.0.1 that
accepts ``POST /v1/traces`` (``ExportTraceServiceRequest``, protobuf, as the SDK's exporter sends
it) and keeps every span, decoded with ``opentelemetry-proto``."""

from __future__ import annotations

import gzip
import http.server
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Self

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def plain(value: AnyValue) -> Any:
    """An OTLP attribute value as a Python value."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [plain(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: plain(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


@dataclass
class CollectedSpan:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: tuple[int, str]  # (code: 0 unset, 1 ok, 2 error; message)
    start_ns: int
    end_ns: int
    resource: dict[str, Any]
    raw: str = field(repr=False, default="")  # the whole span as JSON, for scans

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class Collector:
    """Start with ``with Collector() as c:``; ``c.endpoint`` is the OTEL_EXPORTER_OTLP_ENDPOINT."""

    def __init__(self, port: int = 0) -> None:
        self.spans: list[CollectedSpan] = []
        self.requests: list[str] = []  # request paths, in order
        self.errors: list[str] = []  # requests the collector could not decode
        self._lock = threading.Lock()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                with collector._lock:
                    collector.requests.append(self.path)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                try:
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    collector._keep(request)
                except Exception as e:  # noqa: BLE001 - the test reads collector.errors
                    with collector._lock:
                        collector.errors.append(f"{type(e).__name__}: {e}")
                    self.send_response(400)
                    self.end_headers()
                    return
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-collector", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        kept = []
        for rs in request.resource_spans:
            resource = {kv.key: plain(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    kept.append(CollectedSpan(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        name=s.name, attributes={kv.key: plain(kv.value) for kv in s.attributes},
                        events=[(e.name, {kv.key: plain(kv.value) for kv in e.attributes}) for e in s.events],
                        status=(s.status.code, s.status.message), start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, resource=resource, raw=str(MessageToDict(s))))
        with self._lock:
            self.spans.extend(kept)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def children(spans: list[CollectedSpan]) -> dict[str, list[CollectedSpan]]:
    out: dict[str, list[CollectedSpan]] = {}
    for s in spans:
        out.setdefault(s.parent_id, []).append(s)
    for v in out.values():
        v.sort(key=lambda s: s.start_ns)
    return out


def ancestry(span: CollectedSpan, by_id: dict[str, CollectedSpan]) -> Iterator[CollectedSpan]:
    """``span`` and its ancestors up to the first one whose parent was not collected."""
    seen: set[str] = set()
    current: CollectedSpan | None = span
    while current is not None and current.span_id not in seen:
        seen.add(current.span_id)
        yield current
        current = by_id.get(current.parent_id)


def tree(spans: list[CollectedSpan], keys: tuple[str, ...] = ()) -> str:
    """The spans as an indented tree (roots first): when each started after its root (``+s``), how
    long it took, and the attributes ``keys``."""
    ids = {s.span_id for s in spans}
    kids = children(spans)
    lines: list[str] = []

    def walk(s: CollectedSpan, depth: int, t0: int) -> None:
        shown = " ".join(f"{k.removeprefix('pinrotate.')}={s.attributes[k]}" for k in keys if k in s.attributes)
        error = f" ERROR({s.status[1]})" if s.status[0] == 2 else ""
        lines.append(f"{'  ' * depth}{s.name}  +{(s.start_ns - t0) / 1e9:.2f}s {s.duration_ms:.1f} ms{error}"
                     f"{'  ' + shown if shown else ''}")
        for c in kids.get(s.span_id, []):
            walk(c, depth + 1, t0)

    for root in sorted((s for s in spans if s.parent_id not in ids), key=lambda s: s.start_ns):
        walk(root, 0, root.start_ns)
    return "\n".join(lines)
