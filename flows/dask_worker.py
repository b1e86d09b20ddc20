"""Set-up of the worker processes of the local Dask cluster that a run starts for itself
(``distributed.worker.preload`` in ``flows.runtime.LOCAL_WORKER_CONFIG``; Dask calls ``dask_setup``).

When the run ends, the cluster closes its scheduler and workers together, and a worker whose
heartbeat is in flight at that moment logs "Failed to communicate with scheduler during heartbeat"
with two tracebacks (dask/distributed#7105): on a CLI run's terminal, about one run in six here. It
says nothing about the run, whose outcome the flow reports itself, and no traceback reaches a user
for something that is not even a failure; that one message is dropped. Every other line of the
worker's log is kept. The workers of an existing cluster (``dask_address``) are not touched.

With the OTEL_* variables of a traced run (contract §7), each worker also sets up its span exporter
here, before its first task: Prefect's task run spans in the worker are then recorded too. (A
worker of an existing cluster sets it up at its first drain task, from its own environment.)
"""

from __future__ import annotations

import logging
from typing import Any

from flows import traces

HEARTBEAT_AT_SHUTDOWN = "Failed to communicate with scheduler during heartbeat."


class NoHeartbeatTracebackAtShutdown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != HEARTBEAT_AT_SHUTDOWN


def dask_setup(worker: Any) -> None:
    logging.getLogger("distributed.worker").addFilter(NoHeartbeatTracebackAtShutdown())
    # The run's OTEL_* environment (inherited from the CLI's process): the worker's spans, Prefect's
    # task run spans among them, are recorded from its first task on (flows.traces).
    traces.setup_from_environment()
