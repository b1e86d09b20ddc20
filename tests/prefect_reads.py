"""Reading what a run left in Prefect: its task runs once the server has recorded them.

Prefect 3 records a task run's states from the events its engine emits, after they arrive (the
server's task run recorder), not when the task's state changes: a test that reads the task runs
right after a run may find the last one missing, or one state behind. ``recorded_task_runs``
sends this process's own events first (an in-process flow's), then reads until the server holds
a settled picture: every task run in a final state, and two reads in a row alike. A task run that
never reaches a final state (a drain left Running for ever) still fails the test's assertion,
after ``timeout``.
"""

from __future__ import annotations

import time
from typing import Any

SETTLED_READS = 2  # reads in a row that must agree
PAUSE_S = 0.25


def recorded_task_runs(flow_run_id: Any, *, name_like: str | None = None, timeout: float = 30.0) -> list[Any]:
    """The task runs of ``flow_run_id`` (those whose name is like ``name_like``, if given)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    task_runs = TaskRunFilter(name=TaskRunFilterName(like_=name_like)) if name_like else None
    deadline = time.monotonic() + timeout
    last: tuple[Any, ...] | None = None
    alike = 0
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=flow_runs, task_run_filter=task_runs)
            picture = tuple(sorted((str(r.id), r.state_type, r.run_count) for r in runs))
            final = all(r.state is not None and r.state.is_final() for r in runs)
            alike = alike + 1 if picture == last else 1
            last = picture
            if (final and alike >= SETTLED_READS) or time.monotonic() >= deadline:
                return list(runs)
            time.sleep(PAUSE_S)
