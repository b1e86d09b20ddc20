"""Structured, value-free logging: one line per event, ``key=value`` fields, to stderr.

Only ids, target names, column names, counts and durations are ever passed here; the helpers
refuse ``bytes`` so a ciphertext or key cannot slip into a log line.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

LOGGER_NAME = "pinrotate"
logger = logging.getLogger(LOGGER_NAME)


def _fmt(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError("refusing to log a bytes value")
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, (list, tuple)):
        return ",".join(_fmt(v) for v in value)
    text = str(value)
    return f'"{text}"' if (" " in text or not text) else text


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``event`` with fields, e.g. ``log_event("batch_processed", target="Person", rows=200)``."""
    if logger.isEnabledFor(level):
        parts = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None)
        logger.log(level, "event=%s %s", event, parts, extra={"pinrotate_event": event, "pinrotate_fields": fields})


class _UtcFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def configure_stderr_logging(level: int = logging.INFO) -> None:
    """Log lines to stderr (stdout stays clean for ``--json``). Idempotent."""
    for handler in logger.handlers:
        if getattr(handler, "_pinrotate", False):
            return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_UtcFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    handler._pinrotate = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
