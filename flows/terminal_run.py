"""A flow run started at a terminal (``run``, ``demo``): the stop signals around it and the ways it
can end without a report, each one line (contract §4).

SIGTERM or SIGINT before or after the flow's drains is ``Terminated`` (exit 143 or 130); while the
drains run, the flow's own handler (flows.api_watch.signals_cancel) turns either into a
cancellation of the flow run, and a second Ctrl-C ends the process at once. Nothing here imports
Prefect until a flow runs (``--help`` and the read-only commands never import it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from flows import traces
from flows.reports import fail
from pinrotate_core import rotation

if TYPE_CHECKING:
    from flows.flow import RunOutcome


class Terminated(BaseException):
    """SIGTERM or SIGINT outside a flow run's drains (a BaseException, so that nothing on the way
    swallows it); ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stop_code(signum: int) -> int:
    return rotation.EXIT_INTERRUPTED if signum == signal.SIGINT else rotation.EXIT_TERMINATED


def stopped_by(signum: int) -> str:
    return "interrupted by Ctrl-C" if signum == signal.SIGINT else "stopped by SIGTERM"


def install_stop_handlers() -> None:
    """SIGTERM or SIGINT before or after the flow's drains ends the command with exit 143 or 130.

    While the drains run, the flow's own handler (flows.api_watch.signals_cancel) turns either
    signal into a cancellation of the flow run: every drain, in any process, stops between batches
    and the run report is printed as usual (exit 143, or 130 for a Ctrl-C).
    """
    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def flow_outcome(ns: argparse.Namespace, server: Any = None, cleanup: Callable[[], None] | None = None,
                 **params: Any) -> RunOutcome | int:
    """Run the flow in this process: its ``RunOutcome``, or the exit code of a run that ended
    without one after its one line was printed. ``server``: the run's temporary Prefect server, if
    any. ``cleanup``: what must still happen when the process ends at once (a second Ctrl-C, a lost
    Prefect API), after the server is stopped (the demo's sandbox)."""
    from flows.api_watch import API_ERRORS, STOP_SIGNALS
    from flows.flow import run_flow
    from flows.prefect_api import api_lost_message
    from flows.terminal_progress import SHOW_PROGRESS, wanted

    install_stop_handlers()

    def end(code: int) -> None:
        sys.stderr.flush()
        traces.flush()
        if server is not None:
            server.stop()
        if cleanup is not None:
            cleanup()
        os._exit(code)

    def end_at_once() -> None:
        # A second Ctrl-C: the open batch rolls back with its connection as the process ends.
        fail(ns, rotation.EXIT_INTERRUPTED, "stopped at once by a second Ctrl-C: the open batch rolled back; "
                                            "everything committed stays, the next run resumes")
        end(rotation.EXIT_INTERRUPTED)

    def end_now(lost: RunOutcome) -> None:
        # The run lost its Prefect API and stopped between batches: one line, exit 4, and no
        # wait for Prefect's engine to fail at recording it.
        fail(ns, lost.exit_code, api_lost_message(lost.error or "the Prefect API stopped answering",
                                                  temporary=server is not None))
        end(lost.exit_code)

    STOP_SIGNALS.at_once = end_at_once
    SHOW_PROGRESS.set(wanted(ns.json))
    try:
        return run_flow(on_orchestrator_lost=end_now, **params)
    except API_ERRORS as e:  # the API went away between the check and the flow run's creation
        return fail(ns, rotation.EXIT_FAIL_CLOSED, api_lost_message(f"the Prefect API stopped answering "
                                                                    f"({type(e).__name__}); nothing was run",
                                                                    temporary=server is not None))
    except RuntimeError as e:
        if not isinstance(e.__cause__, API_ERRORS):  # Prefect's "Failed to reach API at ..."
            raise
        return fail(ns, rotation.EXIT_FAIL_CLOSED, api_lost_message(
            f"the Prefect API stopped answering ({type(e.__cause__).__name__}); nothing was run",
            temporary=server is not None))
