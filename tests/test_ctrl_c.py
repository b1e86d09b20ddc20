"""Ctrl-C at the terminal (contract §4): a real SIGINT to the command's process group, as a
terminal sends it, stops the run between batches like SIGTERM: the open batch commits or rolls
back, everything committed stays, the report is printed (the JSON report under ``--json``), exit
130, and the flow run ends Cancelled; with a Prefect server or with the temporary one pinrotate
starts for itself. A second Ctrl-C stops at once, still losing nothing committed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.pinprofile import REPO, PinProfile, seed_profile
from tests.prefect_home import migrated_prefect_home
from tests.prefect_reads import recorded_task_runs
from tests.test_flow import rows_consistent

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups and signals")

ROWS = 200
SLOW = {"batch_size": 10, "inter_batch_delay": 0.3}


def start_run(profile: PinProfile, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    """``python -m flows.rotate run`` in a process group of its own, as a shell starts a foreground job."""
    return subprocess.Popen([sys.executable, "-m", "flows.rotate", "run", "--config", str(profile.config_path),
                             *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_batches(profile: PinProfile, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if profile.key_versions("persons").get(2, 0) > 0:
            return
        assert proc.poll() is None, f"the run ended before its first batch: {proc.communicate()}"
        time.sleep(0.1)
    raise AssertionError("no batch was committed in time")


def ctrl_c(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # the whole foreground group, as the terminal does


STOPPING_HINT = "press Ctrl-C again"  # the first Ctrl-C's line: the run has taken it


def ctrl_c_twice(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[str, str, float]:
    """A Ctrl-C, then a second one once the run has said it took the first (two signals sent before
    the process handles the first arrive as one, as two quick presses would: a graceful stop);
    stdout, stderr, and the seconds from the second Ctrl-C until the command ended."""
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=stream, into=into: into.extend(s), daemon=True)
               for stream, into in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    try:
        ctrl_c(proc)
        deadline = time.monotonic() + 60
        while not any(STOPPING_HINT in line for line in list(err)):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"the run never said it took the first Ctrl-C: {''.join(err)[-4000:]}"
            time.sleep(0.02)
        ctrl_c(proc)
        began = time.monotonic()
        proc.wait(timeout=timeout)
        seconds = time.monotonic() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for reader in readers:
            reader.join(timeout=10)
    return "".join(out), "".join(err), seconds


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[str, str, float]:
    """stdout, stderr, and the seconds from now until the command ended."""
    began = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out, err, time.monotonic() - began


def only_json(out: str, err: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, (out, err[-6000:])
    doc: dict[str, Any] = json.loads(lines[0])
    return doc


def no_env_prefect(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = migrated_prefect_home(tmp_path / "prefect-home")  # the temporary server's SQLite file, this test's own
    return env


def assert_stopped_whole(profile: PinProfile, moved: int) -> None:
    assert 0 < moved < ROWS
    assert rows_consistent(profile) == {2: moved, 1: ROWS - moved}


def test_ctrl_c_with_a_prefect_server_stops_between_batches_reports_exit_130_and_the_flow_run_is_cancelled(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **SLOW)
    proc = start_run(profile, {**os.environ, "PREFECT_API_URL": prefect_api}, "--json")
    wait_for_batches(profile, proc)
    ctrl_c(proc)
    out, err, seconds = finish(proc)
    doc = only_json(out, err)
    assert proc.returncode == 130, err[-6000:]
    assert doc["exit_code"] == 130 and doc["stopped"] == "cancelled"
    assert "Traceback" not in err, err[-6000:]
    assert_stopped_whole(profile, doc["targets"]["Person"]["reencrypted"])
    print(f"stopped {seconds:.1f} s after Ctrl-C")
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(doc["run_id"]).state
    assert state is not None and state.is_cancelled(), state
    task_runs = recorded_task_runs(doc["run_id"])
    # Prefect's view of the stop: the stopped shard (and those it never started) Cancelled, not Completed.
    drains = {t.name: t.state for t in task_runs if t.name.startswith("drain-")}
    assert drains["drain-Person-1/1"] is not None and drains["drain-Person-1/1"].is_cancelled(), drains
    not_cancelled = {name: s for name, s in drains.items() if s is None or not s.is_cancelled()}
    assert not not_cancelled, not_cancelled  # named whole: the repr of all of them was cut


def test_ctrl_c_without_prefect_api_url_keeps_the_temporary_server_until_the_report_is_printed(
        primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **SLOW)
    proc = start_run(profile, no_env_prefect(tmp_path))
    wait_for_batches(profile, proc)
    ctrl_c(proc)
    out, err, seconds = finish(proc)
    assert proc.returncode == 130, err[-6000:]
    assert "Traceback" not in err, err[-6000:]
    assert "stopped between batches: everything committed stays" in out, (out, err[-6000:])
    moved = int(next(line.split()[1] for line in out.splitlines() if line.startswith("Person ")))
    assert_stopped_whole(profile, moved)
    print(f"stopped {seconds:.1f} s after Ctrl-C")


def test_a_second_ctrl_c_stops_at_once_and_loses_nothing_committed(primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **SLOW)
    proc = start_run(profile, no_env_prefect(tmp_path), "--json")
    wait_for_batches(profile, proc)
    out, err, seconds = ctrl_c_twice(proc)
    doc = only_json(out, err)
    assert proc.returncode == 130, err[-6000:]
    assert doc["exit_code"] == 130 and "second Ctrl-C" in doc["error"]
    assert "Traceback" not in err, err[-6000:]
    per_key = rows_consistent(profile)  # every row whole under its own key
    assert sum(per_key.values()) == ROWS and 0 < per_key.get(2, 0) < ROWS
    print(f"stopped {seconds:.1f} s after the second Ctrl-C")


def test_after_a_second_ctrl_c_prefect_shows_the_flow_run_and_its_drains_cancelled_not_running(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **SLOW)
    proc = start_run(profile, {**os.environ, "PREFECT_API_URL": prefect_api}, "--json")
    wait_for_batches(profile, proc)
    out, err, seconds = ctrl_c_twice(proc)
    doc = only_json(out, err)
    assert proc.returncode == 130, err[-6000:]
    assert doc["exit_code"] == 130 and "second Ctrl-C" in doc["error"]
    assert "Traceback" not in err, err[-6000:]
    per_key = rows_consistent(profile)  # every row whole under its own key: nothing committed lost
    assert sum(per_key.values()) == ROWS and 0 < per_key.get(2, 0) < ROWS
    # The error document names no run id: the run is the one flow run of this profile's config.
    with get_client(sync_client=True) as client:
        recent = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=200)  # the session's server
        runs = [r for r in recent if r.parameters.get("config_path") == str(profile.config_path)]
        assert len(runs) == 1, runs
        state = runs[0].state
    assert state is not None and state.is_cancelled(), state
    task_runs = recorded_task_runs(runs[0].id)
    drains = {t.name: t.state for t in task_runs if t.name.startswith("drain-")}
    assert drains, task_runs
    not_cancelled = {name: s for name, s in drains.items() if s is None or not s.is_cancelled()}
    assert not not_cancelled, not_cancelled  # named whole: the repr of all of them was cut
    # Nothing of the run is left Running (or Pending) in Prefect's view.
    assert all(t.state is not None and t.state.is_final() for t in task_runs), {t.name: t.state for t in task_runs}
    print(f"stopped {seconds:.1f} s after the second Ctrl-C")
