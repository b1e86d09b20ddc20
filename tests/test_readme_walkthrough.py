"""README's deployment walkthrough, run as it is written: server, sample, work pool, deploy, worker,
a run cancelled mid-drain, a run to the end, artifacts, the gate, stop.

The block after ``<!-- walkthrough: deployment -->`` is handed to bash unchanged, from the
checkout, in a fresh ``HOME`` (so ~/.prefect and ~/.pinrotate are this test's own) with
``PREFECT_API_URL`` on a free loopback port; nothing else of the shell's Prefect or pinrotate
settings reaches it. What it did is then read from what it left: its output, the worker's log,
the Prefect server's SQLite database and the sample database's key versions.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.pinprofile import REPO
from tests.test_deployment import free_loopback_port, loopback_only

# slow: both tests take minutes (a whole walkthrough; a server left idle for a minute).
pytestmark = [pytest.mark.deployment, pytest.mark.slow]

MARKER = "<!-- walkthrough: deployment -->"
# A bound on the whole block, whose longest parts are the server's first start (SQLite
# migrations) and three flow-run processes; reaching it means a broken walkthrough.
WALKTHROUGH_BOUND_S = 600


def walkthrough_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(re.escape(MARKER) + r"\s*```sh\n(.*?)\n```", text, re.DOTALL)
    assert match, f"README.md has no ```sh block after {MARKER}"
    return match.group(1)


def test_the_readme_names_only_files_the_checkout_has() -> None:
    block = walkthrough_block()
    for path in re.findall(r"\$PWD/(\S+)", block) + re.findall(r"(?m)^(scripts/\S+)", block):
        assert (REPO / path).exists(), f"the walkthrough names {path}, which the checkout lacks"
    assert "--background" not in block, "prefect server start --background dies with the shell that started it"


def walkthrough_env(home: Path) -> tuple[dict[str, str], str]:
    """(the environment, the API URL) the walkthrough runs in: a fresh ``HOME``, ``PREFECT_API_URL``
    on a free loopback port, and nothing else of the shell's Prefect or pinrotate settings."""
    env = loopback_only({k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PINROTATE_", "VAULT_"))})
    api = f"http://127.0.0.1:{free_loopback_port()}/api"
    env.update(HOME=str(home), PREFECT_API_URL=api, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return env, api


def _processes_of(home: Path, named: str = "") -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("HOME") == str(home) and named in " ".join(proc.cmdline()):
                found.append(proc)
    return found


@pytest.fixture
def fresh_home() -> Iterator[Path]:
    # Outside pytest's basetemp, as tests/conftest.py does for its own embedded PostgreSQL: the
    # walkthrough's embedded server (under ~/.pinrotate) runs as an unprivileged user.
    home = Path(tempfile.mkdtemp(prefix="pinrotate-walk-"))
    yield home
    # Whatever a failed walkthrough left running (server, worker, flow run, embedded PostgreSQL).
    for proc in _processes_of(home):
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(_processes_of(home), timeout=20)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    shutil.rmtree(home, ignore_errors=True)


def test_the_readme_deployment_walkthrough_runs_as_written_and_a_cancel_ends_cancelled_without_a_traceback(
        fresh_home: Path) -> None:
    assert (REPO / ".venv" / "bin" / "prefect").exists(), "the walkthrough runs .venv/bin/...: install as the README says"
    env, _ = walkthrough_env(fresh_home)
    proc = subprocess.Popen(["bash", "-eu", "-c", walkthrough_block()], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=WALKTHROUGH_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"the walkthrough did not finish in {WALKTHROUGH_BOUND_S} s:\n{output[-6000:]}") from None
    pinrotate_home = fresh_home / ".pinrotate"
    worker_log = (pinrotate_home / "prefect-worker.log").read_text(encoding="utf-8", errors="replace") \
        if (pinrotate_home / "prefect-worker.log").exists() else ""
    assert proc.returncode == 0, f"the walkthrough exited {proc.returncode}:\n{output[-6000:]}\n--- worker:\n" \
                                 f"{worker_log[-4000:]}"

    # The server ran in the background and was stopped by the last step; nothing of it is left.
    assert "prefect-server: running" in output and "prefect-server: stopped" in output
    assert not (pinrotate_home / "prefect-server.pid").exists()
    # The worker got its SIGTERM from `kill` and shuts down on its own; give it a bound to do so.
    _, left = psutil.wait_procs(_processes_of(fresh_home, "prefect"), timeout=60)
    assert not left, f"still running after the walkthrough stopped everything: {left}"

    # The cancelled run ended Cancelled, the next one Completed (and the gate, exit 0 under -e, opened).
    # `prefect flow-run watch` says "finished" or, when it starts after the end, "already finished".
    assert re.search(r"finished in state 'Cancelled'", output), output[-4000:]
    assert re.search(r"finished (successfully )?in 'Completed'", output), output[-4000:]
    with sqlite3.connect(fresh_home / ".prefect" / "prefect.db") as db:
        runs = db.execute("SELECT state_type, state_name FROM flow_run WHERE NOT auto_scheduled "
                          "ORDER BY start_time").fetchall()
        (cancel_message,) = db.execute("SELECT message FROM flow_run_state WHERE type = 'CANCELLED' "
                                       "AND name = 'Cancelled'").fetchone()
    assert runs == [("CANCELLED", "Cancelled"), ("COMPLETED", "Completed")], runs
    assert re.match(r"stopped between batches; [1-9]\d* rows re-encrypted stay committed, [1-9]\d* left", cancel_message)

    # Cancelling is an outcome: the worker logs one line for it, no traceback and no error.
    assert "pinrotate run ended Cancelled: stopped between batches" in worker_log
    assert "Traceback" not in worker_log and "Unexpected result" not in worker_log
    assert not [line for line in worker_log.splitlines() if re.search(r"\bERROR\b", line)], worker_log[-4000:]


def _readme_line(block: str, starts: str) -> str:
    lines = [line for line in block.splitlines() if line.startswith(starts)]
    assert len(lines) == 1, f"the walkthrough has {len(lines)} lines starting {starts!r}"
    return lines[0]


def test_the_readme_server_start_returns_and_the_server_still_answers_a_minute_later(fresh_home: Path) -> None:
    # The walkthrough's own `start` and `stop` lines, as written. The shell that ran `start` has
    # exited; the server must not have died with it (as `prefect server start --background` does),
    # nor a minute later with nothing to do.
    block = walkthrough_block()
    start = _readme_line(block, "scripts/prefect-server start")
    stop = _readme_line(block, "scripts/prefect-server stop")
    env, api = walkthrough_env(fresh_home)
    started = subprocess.run(["bash", "-eu", "-c", start], cwd=REPO, env=env, capture_output=True, text=True,
                             check=False, timeout=WALKTHROUGH_BOUND_S)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "prefect-server: running" in started.stdout
    try:
        time.sleep(60)  # idle: the one thing this test is about
        with urllib.request.urlopen(api + "/health", timeout=10) as answer:
            assert answer.status == 200
        status = subprocess.run(["scripts/prefect-server", "status"], cwd=REPO, env=env, capture_output=True,
                                text=True, check=False, timeout=60)
        assert status.returncode == 0 and status.stdout.startswith("prefect-server: running"), \
            status.stdout + status.stderr
    finally:
        stopped = subprocess.run(["bash", "-eu", "-c", stop], cwd=REPO, env=env, capture_output=True, text=True,
                                 check=False, timeout=120)
    assert stopped.returncode == 0 and "prefect-server: stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    assert not (fresh_home / ".pinrotate" / "prefect-server.pid").exists()
