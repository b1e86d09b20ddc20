"""``drain.py --trace``: the drain again with tracing on, against an OTLP/HTTP trace collector in
the benchmark's own process (it accepts what the SDK's exporter sends to ``/v1/traces``, decodes it
and counts the spans, nothing more)."""

from __future__ import annotations

import http.server
import os
import statistics
import threading
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpSink:
    def __init__(self) -> None:
        self.spans: dict[str, int] = {}  # span name -> how many arrived
        lock = threading.Lock()
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                with lock:
                    for rs in request.resource_spans:
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                sink.spans[s.name] = sink.spans.get(s.name, 0) + 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def traced_rounds(single: Callable[..., tuple[int, float, int, Any]], repeat: int, untraced: float,
                  untraced_cpu: list[float], rows: int, cleanups: list[Callable[[], None]]) -> None:
    """The drain again, ``repeat`` times, with tracing set up as a run sets it up (flows.traces, from
    the OTEL variables) against a collector in this process; prints its rate and this process's own
    CPU per row (steadier than rows/s on a shared machine; the collector's decoding included)
    against the untraced rounds'. After them: a process's tracer provider is set once and for all."""
    from flows import traces

    sink = OtlpSink()
    cleanups.insert(0, sink.stop)
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
    os.environ.setdefault("OTEL_SERVICE_NAME", "pinrotate-benchmark")
    assert traces.setup_from_environment()
    rates, own = [], []
    for round_no in range(1, repeat + 1):
        moved, secs, _, cpu = single(traced=True)
        rates.append(moved / secs)
        own.append(cpu.python / moved * 1e6)
        print(f"traced round {round_no}/{repeat}: drain {rates[-1]:,.0f} rows/s, {own[-1]:.1f} us own CPU per row",
              flush=True)
    traces.flush()
    rate, cpu_on = statistics.median(rates), statistics.median(own)
    cpu_off = statistics.median(untraced_cpu) / rows * 1e6
    print(f"drain, tracing on: {rate:,.0f} rows/s = {rate / untraced:.3f} of tracing off; own CPU per row "
          f"{cpu_on:.1f} us vs {cpu_off:.1f} us off = {cpu_on / cpu_off:.3f} (medians of {repeat}); "
          f"exported: {', '.join(f'{n} {name}' for name, n in sorted(sink.spans.items()))}")
