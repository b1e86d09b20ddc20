"""Spans of the core, through ``opentelemetry-api`` only (contract §7, Traces).

The core never sets up an exporter: whoever runs it (``flows/``, or an application embedding the
core) installs a tracer provider, or none. Without one, every helper here returns at once, without
starting a span, so a drain without tracing does no tracing work at all.

What a span may carry: names (target, step), the run id, the current key's id, counts, durations
and error kinds (``key_unavailable``, ``decrypt_failed``, ``conflict``, ``db_error``). Never a value,
a ciphertext, a key or a row id, and never an exception's message (a driver's message may quote a
value): an error is recorded as its kind, in the span's status and ``error.type``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

import psycopg
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from .errors import CiphertextInvalid, ConflictError, DatabaseError, KeyUnavailable

TRACER_NAME: Final = "pinrotate"
BATCH_SPAN: Final = "pinrotate.batch"
DRAIN_SPAN: Final = "pinrotate.drain"

RUN_ID: Final = "pinrotate.run_id"
TARGET: Final = "pinrotate.target"
CURRENT_KEY: Final = "pinrotate.current_key"
BATCH_SIZE: Final = "pinrotate.batch_size"
ROWS: Final = "pinrotate.rows"
ERROR_TYPE: Final = "error.type"  # OpenTelemetry's semantic convention for an error's kind
ERROR_EVENT: Final = "pinrotate.error"  # an event per kind of row-level error in a batch, with its count

Attributes = Mapping[str, str | bool | int | float]


_tracers: dict[int, tuple[trace.TracerProvider, trace.Tracer]] = {}  # by id(provider); it is set once a process


def tracer() -> trace.Tracer | None:
    """The tracer of the process's provider, or None when no provider was installed (tracing off).

    Checked on every call (an environment look-up and an ``isinstance``): a provider installed
    after import, as ``flows`` does, is used from then on."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    cached = _tracers.get(id(provider))
    if cached is None or cached[0] is not provider:
        cached = _tracers[id(provider)] = (provider, provider.get_tracer(TRACER_NAME))
    return cached[1]


def error_kind(exc: BaseException) -> str:
    """An exception as its kind, never its message: one of the error reasons of the metrics, or the
    exception's class name for anything else (a name, not data)."""
    if isinstance(exc, KeyUnavailable):
        return "key_unavailable"
    if isinstance(exc, (DatabaseError, psycopg.Error)):
        return "db_error"
    if isinstance(exc, ConflictError):
        return "conflict"
    if isinstance(exc, CiphertextInvalid):
        return "decrypt_failed"
    return type(exc).__name__


def row_error_kind(reason: str) -> str:
    """A failed row's reason as an error kind (a value naming a key the keyring lacks is a key
    provider failure, as the metrics count it)."""
    return "key_unavailable" if reason == "unknown_key" else reason


def set_error(span: Span, kind: str) -> None:
    """Mark ``span`` failed with ``kind`` as its status and ``error.type``; no message, no traceback."""
    span.set_attribute(ERROR_TYPE, kind)
    span.set_status(Status(StatusCode.ERROR, kind))


def count_errors(span: Span, kinds: Iterable[str]) -> None:
    """One ``pinrotate.error`` event per kind, with how many rows had it (never which)."""
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    for kind, n in counts.items():
        span.add_event(ERROR_EVENT, {ERROR_TYPE: kind, "pinrotate.count": n})


_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()  # what every helper returns when tracing is off


def span(name: str, attributes: Attributes) -> contextlib.AbstractContextManager[Span | None]:
    """A span named ``name`` around the block, current while it runs; None when tracing is off.
    An exception leaving the block marks the span failed with its kind (not its message) and goes on."""
    t = tracer()
    return _OFF if t is None else _span(t, name, attributes)


@contextlib.contextmanager
def _span(t: trace.Tracer, name: str, attributes: Attributes) -> Iterator[Span]:
    with t.start_as_current_span(name, attributes=attributes, record_exception=False,
                                 set_status_on_exception=False) as s:
        try:
            yield s
        except BaseException as e:
            set_error(s, error_kind(e))
            raise


def batch_span(run_id: str, target: str, current_key: str, batch_size: int,
               **more: str | bool | float) -> contextlib.AbstractContextManager[Span | None]:
    """The span of one batch transaction: ``pinrotate.batch`` with the attributes of contract §7
    (``pinrotate.rows`` is set by the caller once the batch is written, see ``batch_written``)."""
    t = tracer()
    if t is None:
        return _OFF
    attributes: dict[str, str | bool | int | float] = {
        RUN_ID: run_id, TARGET: target, CURRENT_KEY: current_key, BATCH_SIZE: int(batch_size)}
    attributes.update({f"pinrotate.{k}": v for k, v in more.items()})
    return _span(t, BATCH_SPAN, attributes)


def batch_written(s: Span | None, rows: int, conflicts: int, failed_reasons: Iterable[str]) -> None:
    """What a committed batch did, as counts: rows written (as the report counts them), CONFLICTs,
    and a ``pinrotate.error`` event per kind of failed row."""
    if s is None:
        return
    s.set_attribute(ROWS, int(rows))
    s.set_attribute("pinrotate.conflicts", int(conflicts))
    kinds = [row_error_kind(r) for r in failed_reasons]
    s.set_attribute("pinrotate.failed", len(kinds))
    if conflicts:
        s.add_event(ERROR_EVENT, {ERROR_TYPE: "conflict", "pinrotate.count": int(conflicts)})
    count_errors(s, kinds)
