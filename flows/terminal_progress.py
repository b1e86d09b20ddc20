"""The progress display of a run (and of a gate's deep pass) on an interactive terminal (contract §4):
rows done of the backlog, per target, with the rate and the time left, drawn by ``rich.progress``
on stderr. Only when stderr is a TTY and the command was not asked for ``--json``; otherwise
nothing is drawn and the plain log lines stay as they are.

While the display is up, the run's log lines are printed above it (never through it), and the one
line per batch (``batch_processed``) is left out of the terminal: the bar says the same. Names and
counts only, never a value.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from pinrotate_core.log import LOGGER_NAME

# Set by the CLI for the command it runs: draw a progress display (stderr a TTY, no --json)?
SHOW_PROGRESS: contextvars.ContextVar[bool] = contextvars.ContextVar("pinrotate_show_progress", default=False)


def wanted(json_output: bool) -> bool:
    """A display belongs on an interactive terminal only: stderr a TTY, no ``--json``."""
    return not json_output and sys.stderr.isatty()


class _RowsPerSecond(TransferSpeedColumn):
    """``1,234 rows/s`` (rich's own speed column speaks of bytes)."""

    def render(self, task: Any) -> Any:
        from rich.text import Text

        speed = task.finished_speed or task.speed
        return Text("? rows/s" if speed is None else f"{speed:,.0f} rows/s", style="progress.data.speed")


class _NoBatchLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "pinrotate_event", None) != "batch_processed"


class TargetsProgress:
    """One bar per target: rows done of its backlog. Thread-safe (batches arrive from drain threads)."""

    def __init__(self, progress: Progress, title: str) -> None:
        self.progress = progress
        self.title = title
        self._tasks: dict[str, TaskID] = {}
        self._lock = threading.Lock()

    def target(self, name: str, backlog: int) -> None:
        """Add ``backlog`` rows to ``name``'s total (a target drained as several shards adds each)."""
        with self._lock:
            if name not in self._tasks:
                self._tasks[name] = self.progress.add_task(name, total=max(0, backlog))
            else:
                task = self._tasks[name]
                self.progress.update(task, total=max(0, (self.progress.tasks[task].total or 0) + backlog))

    def start(self, name: str, rows: int) -> None:
        """A pass over ``name`` begins (again, for a gate's second look): ``rows`` to read."""
        with self._lock:
            if name in self._tasks:
                self.progress.reset(self._tasks[name], total=max(0, rows))
            else:
                self._tasks[name] = self.progress.add_task(name, total=max(0, rows))

    def advance(self, name: str, rows: int) -> None:
        with self._lock:
            task = self._tasks.get(name)
            if task is None:
                task = self._tasks[name] = self.progress.add_task(name, total=None)
            self.progress.advance(task, rows)

    def settle(self, name: str, recount: int) -> None:
        """A shard ended: its planned backlog was ``recount`` off what it turned out to hold."""
        if recount:
            self.target(name, recount)


@contextlib.contextmanager
def terminal_progress(title: str) -> Iterator[TargetsProgress | None]:
    """While the block runs, a live progress display on stderr, if ``SHOW_PROGRESS``; else None."""
    if not SHOW_PROGRESS.get():
        yield None
        return
    console = Console(file=sys.stderr)
    progress = Progress(TextColumn("[bold]{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("rows"), TaskProgressColumn(), _RowsPerSecond(), TimeElapsedColumn(),
                        TextColumn("left"), TimeRemainingColumn(), console=console, transient=False,
                        redirect_stderr=False, redirect_stdout=False, refresh_per_second=4)
    console.print(title)
    with progress, _log_lines_above(progress):
        yield TargetsProgress(progress, title)


@contextlib.contextmanager
def _log_lines_above(progress: Progress) -> Iterator[None]:
    """Print the log lines of pinrotate and Prefect above the display while it is up, without the
    per-batch lines; put every handler back afterwards."""
    restore: list[Any] = []
    proxy = _ConsoleWriter(progress.console)
    for name in (LOGGER_NAME, "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if hasattr(handler, "console") and isinstance(handler.console, Console):
                restore.append((handler, "console", handler.console))
                handler.console = progress.console
            elif isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
                restore.append((handler, "stream", handler.stream))
                handler.setStream(proxy)
                if name == LOGGER_NAME:
                    no_batches = _NoBatchLines()
                    handler.addFilter(no_batches)
                    restore.append((handler, "filter", no_batches))
    try:
        yield
    finally:
        for handler, what, old in reversed(restore):
            if what == "console":
                handler.console = old
            elif what == "stream":
                handler.setStream(old)
            else:
                handler.removeFilter(old)


class _ConsoleWriter:
    """A text stream whose lines the live console prints above its display."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._buffer = ""

    def write(self, text: str) -> int:
        self._buffer += text
        while "\n" in self._buffer:
            line, self._buffer = self._buffer.split("\n", 1)
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            self.console.print(self._buffer, markup=False, highlight=False, soft_wrap=True)
            self._buffer = ""
