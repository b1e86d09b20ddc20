"""Prefect flows over pinrotate_core. Importing this package imports nothing from Prefect."""

import os

# Prefect reads these when it is first imported, and every entry point of this package imports the
# package before anything else, whatever order its own imports are in: capture the core's log lines
# in the run logs, give the temporary local API (no PREFECT_API_URL) time to start on a busy 2-core
# machine, and send no telemetry from a machine that handles PII. The core logs outside flow runs
# too (the CLI's preflight, a run's last lines): those lines go to stderr only, without a warning
# from Prefect's API handler for each one.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "pinrotate")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
