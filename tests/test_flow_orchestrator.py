"""A run whose Prefect API goes away: the drains go on through a short outage and stop, between
batches, once it is lost; the command line says so in one line, exit 4, no traceback.

Driven as an operator would: ``python -m flows.rotate run`` with no ``PREFECT_API_URL``, so that
Prefect starts a temporary server of its own for the run, and that server is killed mid-run; and
with ``PREFECT_API_URL`` naming a real ``prefect server start`` that is stopped mid-run (the state
the README's deployment block can leave a shell in).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.pinprofile import REPO, PinProfile, seed_profile
from tests.prefect_home import migrated_prefect_home
from tests.test_flow import rows_consistent

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process trees")

ROWS = 800
SLOW = {"batch_size": 10, "inter_batch_delay": 0.2}


def _temporary_prefect_server(cli: subprocess.Popen[str], timeout: float = 240) -> psutil.Process:
    """The uvicorn process Prefect starts under the CLI when no PREFECT_API_URL is set."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(cli.pid).children(recursive=True):
            try:
                if "uvicorn" in " ".join(child.cmdline()):
                    return child
            except psutil.NoSuchProcess:
                continue
        assert cli.poll() is None, "the run ended before its temporary Prefect server was seen"
        time.sleep(0.2)
    raise AssertionError("no temporary Prefect server under the CLI")


def _wait_for_batches(profile: PinProfile, cli: subprocess.Popen[str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if profile.key_versions("persons").get(2, 0) > 0:
            return
        assert cli.poll() is None, f"the run ended before its first batch: {cli.communicate()}"
        time.sleep(0.2)
    raise AssertionError("no batch was committed in time")


@pytest.mark.slow
def test_a_run_whose_temporary_prefect_server_dies_stops_between_batches_with_one_line_and_exit_4(
        primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **SLOW)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = migrated_prefect_home(tmp_path / "prefect-home")  # the temporary server's SQLite file, this test's own
    cli = subprocess.Popen([sys.executable, "-m", "flows.rotate", "run", "--config", str(profile.config_path), "--json"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server = _temporary_prefect_server(cli)
        _wait_for_batches(profile, cli)
        server.kill()
        out, err = cli.communicate(timeout=300)
    finally:
        if cli.poll() is None:
            cli.kill()
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, (out, err[-6000:])
    doc = json.loads(lines[0])
    assert cli.returncode == 4, err[-6000:]
    assert doc["exit_code"] == 4
    assert "lost the Prefect API" in doc["error"] and "stopped between batches" in doc["error"]
    assert "the run's temporary Prefect server stopped" in doc["error"]  # what happened, and what to do
    assert "Traceback" not in err, err[-6000:]
    # It stopped: rows are left for the next run, and every row reads whole under its own key.
    assert sum(rows_consistent(profile).values()) == ROWS
    left = sum(profile.key_versions(t).get(1, 0) for t in ("persons", "person_documents", "requisite_templates",
                                                            "verification_requests"))
    assert left > 0 and f"{left} left for the next run" in doc["error"]
    # One line says why the run stopped; no error line other than the loss itself.
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert any("event=prefect_api_lost" in line for line in errors), err[-6000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prefect_server_start(home: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``prefect server start`` on a free loopback port, in a session of its own; (process, API URL)
    once it answers."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=migrated_prefect_home(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_UI_ENABLED="false")
    log = (home / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_server(proc)
            raise AssertionError(f"prefect server start did not answer: {(home / 'server.log').read_text()[-4000:]}")
        time.sleep(0.5)


def _stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stopped as an operator stops it (Ctrl-C in its own terminal, or `kill`): its whole group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def stoppable_prefect_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    home = tmp_path / "prefect-server-home"
    home.mkdir()
    proc, url = _prefect_server_start(home)
    try:
        yield proc, url
    finally:
        _stop_server(proc)


@pytest.mark.slow
def test_a_run_whose_prefect_server_is_stopped_mid_run_stops_between_batches_with_one_line_naming_it_and_exit_4(
        primary_database_url: str, tmp_path: Path,
        stoppable_prefect_server: tuple[subprocess.Popen[bytes], str]) -> None:
    server, url = stoppable_prefect_server
    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **SLOW)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_API_URL=url, PREFECT_HOME=str(tmp_path / "client-home"))
    cli = subprocess.Popen([sys.executable, "-m", "flows.rotate", "run", "--config", str(profile.config_path),
                            "--json"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        _wait_for_batches(profile, cli)
        _stop_server(server)
        out, err = cli.communicate(timeout=300)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, (out, err[-6000:])
    doc = json.loads(lines[0])
    assert cli.returncode == 4 and doc["exit_code"] == 4, err[-6000:]
    assert set(doc) == {"error", "exit_code"}, doc
    # One line: what happened, the URL, and what to do.
    assert "lost the Prefect API" in doc["error"] and "stopped between batches" in doc["error"]
    assert url in doc["error"], doc["error"]
    assert "start that server again" in doc["error"] and "unset PREFECT_API_URL" in doc["error"]
    assert [line for line in err.splitlines() if line.startswith("pinrotate: error:")] == \
        [f"pinrotate: error: {doc['error']}"], err[-6000:]
    assert "Traceback" not in err, err[-6000:]
    # Nothing committed is lost: every row reads whole, under the old key or the new one; rows are
    # left for the next run.
    assert sum(rows_consistent(profile).values()) == ROWS
    left = sum(profile.key_versions(t).get(1, 0) for t in ("persons", "person_documents", "requisite_templates",
                                                            "verification_requests"))
    assert left > 0 and f"{left} left for the next run" in doc["error"]
