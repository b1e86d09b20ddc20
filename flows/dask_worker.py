"""Set-up of the worker processes of the local Dask cluster that a run starts for itself
(``distributed.worker.preload`` in ``flows.runtime.LOCAL_WORKER_CONFIG``; Dask calls ``dask_setup``).

When the run ends, the cluster closes its scheduler and workers together, and a worker whose
heartbeat is in flight at that moment logs "Failed to communicate with scheduler during heartbeat"
with two tracebacks (dask/distributed#7105): on a CLI run's terminal, about one run in six here. It
says nothing about the run, whose outcome the flow reports itself, and no traceback reaches a user
for something that is not even a failure; that one message is dropped. Every other line of the
worker's log is kept. The workers of an existing cluster (``dask_address``) are not touched.

A Ctrl-C at the terminal reaches the whole foreground process group, and the workers of a local
cluster are in it: each would die of a KeyboardInterrupt mid-batch (tracebacks on the terminal, the
nanny restarting it, the run left waiting on shards that never report). They ignore SIGINT: the
CLI's own handler turns the Ctrl-C into a cancellation of the flow run, which every drain watches
and obeys between batches (flows.api_watch); a second Ctrl-C ends the CLI's process, and the
workers end with it (Dask's workers exit when their parent does), the open batch rolling back.

With the OTEL_* variables of a traced run (contract §7), each worker also sets up its span exporter
here, before its first task: Prefect's task run spans in the worker are then recorded too. (A
worker of an existing cluster sets it up at its first drain task, from its own environment.)
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from flows import traces

HEARTBEAT_AT_SHUTDOWN = "Failed to communicate with scheduler during heartbeat."


class NoHeartbeatTracebackAtShutdown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != HEARTBEAT_AT_SHUTDOWN


def ignore_ctrl_c() -> None:
    """SIGINT ignored in this process (only the main thread may set a handler; Dask calls the
    preload from the worker's event loop, which runs there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def dask_setup(worker: Any) -> None:
    ignore_ctrl_c()
    logging.getLogger("distributed.worker").addFilter(NoHeartbeatTracebackAtShutdown())
    # The run's OTEL_* environment (inherited from the CLI's process): the worker's spans, Prefect's
    # task run spans among them, are recorded from its first task on (flows.traces).
    traces.setup_from_environment()
