"""Set-up of the worker processes of the local Dask cluster that a run starts for itself
(``distributed.worker.preload`` in ``flows.runtime.LOCAL_WORKER_CONFIG``; Dask calls ``dask_setup``).

When the run ends, the cluster closes its scheduler and workers together, and a worker whose
heartbeat is in flight at that moment logs "Failed to communicate with scheduler during heartbeat"
with two tracebacks (dask/distributed#7105): on a CLI run's terminal, about one run in six here. It
says nothing about the run, whose outcome the flow reports itself, and no traceback reaches a user
for something that is not even a failure; that one message is dropped. Every other line of the
worker's log is kept. The workers of an existing cluster (``dask_address``) are not touched.
"""

from __future__ import annotations

import logging
from typing import Any

HEARTBEAT_AT_SHUTDOWN = "Failed to communicate with scheduler during heartbeat."


class NoHeartbeatTracebackAtShutdown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != HEARTBEAT_AT_SHUTDOWN


def dask_setup(worker: Any) -> None:
    logging.getLogger("distributed.worker").addFilter(NoHeartbeatTracebackAtShutdown())
