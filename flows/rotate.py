"""``python -m flows.rotate``: the command line (contract §4); and ``flows/rotate.py:pinrotate_rotate``,
the entry point of the Prefect deployment.
"""

from __future__ import annotations

if __name__ == "__main__":
    # The command line comes first so that --help, inventory, gate and keys answer without
    # importing Prefect at all; `run` and `demo` import the flow (flows.flow) when they need it.
    from flows.cli import main

    raise SystemExit(main())

from flows.flow import FLOW_NAME, RunOutcome, pinrotate_rotate, run_flow

__all__ = ["FLOW_NAME", "RunOutcome", "pinrotate_rotate", "run_flow"]
