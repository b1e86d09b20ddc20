"""A run whose Prefect API goes away: the drains go on through a short outage and stop, between
batches, once it is lost; the command line says so in one line, exit 4, no traceback.

Driven as an operator would: ``python -m flows.rotate run`` with no ``PREFECT_API_URL``, so that
Prefect starts a temporary server of its own for the run, and that server is killed mid-run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.pinprofile import REPO, PinProfile, seed_profile
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
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # the temporary server's SQLite file, this test's own
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
