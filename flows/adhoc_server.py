"""The Prefect server that ad hoc runs at a terminal share (issue 33, point 7).

Without ``PREFECT_API_URL``, every ``run`` used to start a temporary Prefect server and stop it at
the end: about 5 of a run's 10 s with nothing to do are that server's start-up (its imports). A
person at a terminal runs the command again and again; there, the first run starts a server that
the following runs reuse, and that stops by itself once no run has used it for
``PINROTATE_PREFECT_SERVER_IDLE`` seconds (default 900). Run history is kept as before: the server
uses Prefect's own database (SQLite under ``PREFECT_HOME``), as the temporary server does.

Which server a run uses (``PINROTATE_PREFECT_SERVER``):

- ``reuse``: the shared server of ``$PINROTATE_HOME`` (started if none runs);
- ``temporary``: a server of the run's own, stopped when it ends (nothing outlives the command);
- unset: ``reuse`` on an interactive terminal (stderr a TTY, no ``--json``), ``temporary``
  otherwise, so that scripts, CI jobs and schedulers never leave a process behind.

Its files live in ``$PINROTATE_HOME/prefect-server/``: ``server.json`` (the keeper's process id, the
port, what it was started with), ``use.lock`` (each run holds it shared while it runs; the keeper
takes it exclusively only to stop), ``start.lock`` (one starter at a time) and ``last-used``.

The keeper (``python -m flows.adhoc_server keep``) is a small process in a session of its own (a
Ctrl-C at the terminal never reaches it) that runs Prefect's server as its child, the way the
temporary server runs. A server started with other Prefect settings or another Python is never
reused: that run gets a temporary server of its own. Nothing here imports Prefect.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pinrotate_core.errors import ConfigError

MODE_ENV = "PINROTATE_PREFECT_SERVER"
IDLE_ENV = "PINROTATE_PREFECT_SERVER_IDLE"
IDLE_DEFAULT_S = 900.0
CHECK_EVERY_S = 1.0  # how often the keeper looks whether it is idle, and whether its server still runs
START_TIMEOUT_S = 180.0


def mode(json_output: bool) -> str:
    """``reuse`` or ``temporary`` for this run (see the module's text)."""
    chosen = os.environ.get(MODE_ENV, "").strip().lower()
    if chosen in ("reuse", "temporary"):
        return chosen
    if chosen:
        raise ConfigError(f"{MODE_ENV}={chosen!r}: must be reuse or temporary")
    return "reuse" if not json_output and sys.stderr.isatty() else "temporary"


def idle_seconds() -> float:
    raw = os.environ.get(IDLE_ENV, "").strip()
    if not raw:
        return IDLE_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{IDLE_ENV}={raw!r}: must be a number of seconds above 0")
    return value


def state_dir() -> Path:
    from pinrotate_core.config import pinrotate_home

    return pinrotate_home() / "prefect-server"


def fingerprint() -> str:
    """What the server was started with: the Python, Prefect's version and every Prefect setting
    of the environment. A run with any of them different does not reuse it."""
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("PREFECT_") and k != "PREFECT_API_URL")
    what = {"python": sys.executable, "prefect": importlib.metadata.version("prefect"), "env": settings,
            "home": str(Path.home())}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a keeper still running: not gone, not a zombie nobody reaped yet, and not
    another program that was given the same process id since."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        if not Path("/proc/self").exists():  # no /proc: ask the kernel whether it exists at all
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X") and b"flows.adhoc_server" in cmdline


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("pid"), int) else None


def _touch(path: Path) -> None:
    path.touch()
    os.utime(path)


@contextlib.contextmanager
def _locked(path: Path, how: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        os.close(fd)  # releases the lock


class SharedServer:
    """A run's use of the shared server: ``url``; ``wait_until_up`` before the flow; ``stop`` (or
    the block's end) releases it and leaves the server running for the next run."""

    def __init__(self, url: str, pid: int, use_fd: int, directory: Path, started: bool) -> None:
        self.url, self.pid, self.started = url, pid, started
        self.used = False  # a run its checks refused never used it
        self._use_fd: int | None = use_fd
        self._dir = directory

    def wait_until_up(self, timeout: float = START_TIMEOUT_S) -> None:
        from flows.server_process import TemporaryServerFailed, server_log_path

        self.used = True
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if not _alive(self.pid) or time.monotonic() > deadline:
                raise TemporaryServerFailed(f"the Prefect server of ad hoc runs (process {self.pid}) did not answer "
                                            f"at {self.url}; its output is in {server_log_path()}; "
                                            f"{MODE_ENV}=temporary runs with a server of the run's own")
            time.sleep(0.02)

    def start(self) -> None:
        """As a temporary server's ``start``: wait until it answers."""
        self.wait_until_up()

    def stop(self) -> None:
        """Release the server: it stays up for the next run, idle time counting from now. A server
        this run started but never used (its checks refused it: a one-line error, nothing else) is
        marked idle for long already, so that its keeper stops it at once unless another run holds
        it meanwhile: a refused command leaves nothing behind."""
        if self._use_fd is None:
            return
        with contextlib.suppress(OSError):
            if self.started and not self.used:
                os.utime(self._dir / "last-used", (0, 0))
            else:
                _touch(self._dir / "last-used")
        os.close(self._use_fd)
        self._use_fd = None
        if self.started and self.used:  # said once, by the run that started it: a process outlives this command
            sys.stderr.write(f"pinrotate: the Prefect server of ad hoc runs stays up for the next run at {self.url} "
                             f"(process {self.pid}; it stops after {_minutes(idle_seconds())} unused; "
                             f"{MODE_ENV}=temporary runs without it)\n")
            sys.stderr.flush()


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def attach() -> SharedServer | None:
    """The shared server of ``$PINROTATE_HOME``, started if none runs (not waited for: the run's
    checks go on while it starts), and held in use until ``stop``. None when a server started with
    other settings is in use by another run (this run then takes a temporary server)."""
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    idle = idle_seconds()
    use_fd = os.open(directory / "use.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # Shared: many runs at once. Blocks only while a keeper that found itself idle stops (a moment).
        fcntl.flock(use_fd, fcntl.LOCK_SH)
        _touch(directory / "last-used")
        with _locked(directory / "start.lock", fcntl.LOCK_EX):
            state = _read_state(directory / "server.json")
            mine = fingerprint()
            if state is not None and _alive(state["pid"]):
                if state.get("fingerprint") != mine:
                    os.close(use_fd)
                    return None
                return SharedServer(state["url"], state["pid"], use_fd, directory, started=False)
            from flows.server_process import free_port

            port = free_port()
            keeper = _spawn_keeper(port, idle)
            url = f"http://127.0.0.1:{port}/api"
            (directory / "server.json").write_text(json.dumps(
                {"pid": keeper.pid, "port": port, "url": url, "fingerprint": mine, "idle_s": idle,
                 "started": time.time()}))
            return SharedServer(url, keeper.pid, use_fd, directory, started=True)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(use_fd)
        raise


def _spawn_keeper(port: int, idle: float) -> subprocess.Popen[Any]:
    from flows.server_process import server_log_path

    log_path = server_log_path()
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    here = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")])),
           "PINROTATE_HOME": str(state_dir().parent.resolve())}
    if os.environ.get("PREFECT_HOME"):  # its database: where this run's would be (the keeper runs in /)
        env["PREFECT_HOME"] = str(Path(os.environ["PREFECT_HOME"]).expanduser().resolve())
    env.pop("PREFECT_API_URL", None)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "flows.adhoc_server", "keep", str(port), str(idle)],
                                env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                cwd="/")


# -- the keeper ---------------------------------------------------------------------------------------

def keep(port: int, idle: float) -> int:
    """Run Prefect's server (``flows.server_process``'s command) until no run has used it for ``idle``
    seconds, or until SIGTERM; then stop it and forget it."""
    from flows.server_process import spawn_server

    directory = state_dir()
    server = spawn_server(port)
    stopping = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_fd = os.open(directory / "use.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while not stopping and server.poll() is None:
            time.sleep(CHECK_EVERY_S)
            try:
                fcntl.flock(use_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no run holds it now
            except BlockingIOError:
                continue
            try:
                last = (directory / "last-used").stat().st_mtime
            except OSError:
                last = 0.0
            if time.time() - last >= idle:
                break
            fcntl.flock(use_fd, fcntl.LOCK_UN)
        # Stopping: forget the server first (held exclusively, so no run is attaching meanwhile).
        with _locked(directory / "start.lock", fcntl.LOCK_EX):
            state = _read_state(directory / "server.json")
            if state is not None and state["pid"] == os.getpid():
                (directory / "server.json").unlink(missing_ok=True)
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        return 0
    finally:
        os.close(use_fd)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "keep":
        raise SystemExit(keep(int(sys.argv[2]), float(sys.argv[3])))
    raise SystemExit("usage: python -m flows.adhoc_server keep PORT IDLE_SECONDS (started by `run`, not by hand)")
