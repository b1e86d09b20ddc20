"""The process of a local Prefect server (the temporary server of a run, the shared server of
flows/adhoc_server): spawned without importing Prefect, in a session of its own, its output in
``$PINROTATE_HOME/prefect-server.log``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from pinrotate_core.errors import PinrotateError


class TemporaryServerFailed(PinrotateError):
    """The temporary Prefect server of an ad hoc run did not start (exit 1, one line)."""


# The server's process starts here: on Linux it first asks to be sent SIGTERM when the CLI's
# process ends, however it ends (a SIGKILL included), so that no server outlives the run it served;
# then it runs uvicorn as ``python -m uvicorn ARGS`` would. (Not a preexec_fn: unsafe with threads.)
_LAUNCH = """
import runpy, signal, sys
if sys.platform.startswith("linux"):
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
sys.argv = ["uvicorn", *sys.argv[1:]]
runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_server(port: int) -> subprocess.Popen[Any]:
    """Prefect's own temporary-server command (``SubprocessASGIServer._run_uvicorn_command``), in a
    session of its own, spawned without importing Prefect here: the server's start-up (its imports,
    seconds) is most of an ad hoc run with nothing to do, and the import of ``prefect.settings``
    (about 0.7 s) would only delay it. The server reads Prefect's settings (environment, profile)
    itself, as the CLI would."""
    import importlib.util

    spec = importlib.util.find_spec("prefect")
    assert spec is not None and spec.submodule_search_locations, "prefect is not installed"
    app_dir = Path(next(iter(spec.submodule_search_locations))).parent
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    if "prefect.settings" in sys.modules:  # settings made in this process (a test harness) reach the server too
        from prefect.settings import get_current_settings

        env.update(get_current_settings().to_environment_variables(exclude_unset=True))
    # Its output goes to a log file, never to the run's terminal: a server stopped while it starts
    # (the run refused to start) logs tracebacks that are not the user's to read.
    log_path = server_log_path()
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, "--app-dir", str(app_dir), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on"],
            env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def server_log_path() -> Path:
    """Where the temporary Prefect server of an ad hoc run writes its output."""
    from pinrotate_core.config import pinrotate_home

    return pinrotate_home() / "prefect-server.log"


