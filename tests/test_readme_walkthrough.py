"""README's deployment walkthrough, run as it is written: server, sample, work pool, deploy, worker,
a run cancelled mid-drain, a run to the end, artifacts, the gate, stop (the schedule paused).

The README's own-database block and then the block after ``<!-- walkthrough: deployment -->`` are
handed to one bash unchanged, one after the other, as a person follows the README in one shell:
from a checkout of their own (symlinks to this one's files), in a fresh ``HOME`` (so ~/.prefect and
~/.pinrotate* are this test's own) with ``PREFECT_API_URL`` on a free loopback port and
``PINROTATE_DATABASE_URL`` naming a fresh database for the own-database block (as its first comment
offers); nothing else of the shell's Prefect or pinrotate settings reaches it. The blocks must
compose: each keeps its own keyring. What they did is then read from what they left: the output,
the worker's log, the Prefect server's SQLite database and the databases' key versions.
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
import psycopg
import pytest

from tests.pinprofile import REPO
from tests.readme_blocks import own_database_block, readme_block
from tests.test_deployment import free_loopback_port, loopback_only

# slow: both tests take minutes (a whole walkthrough; a server left idle for a minute).
pytestmark = [pytest.mark.deployment, pytest.mark.slow]

MARKER = "<!-- walkthrough: deployment -->"
# A bound on the whole block, whose longest parts are the server's first start (SQLite
# migrations) and three flow-run processes; reaching it means a broken walkthrough.
WALKTHROUGH_BOUND_S = 600


def walkthrough_block() -> str:
    return readme_block(MARKER)


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


def a_checkout_of_its_own(home: Path) -> Path:
    """A folder that has the checkout's files (symlinked), where the blocks may write theirs (mine.toml)."""
    work = home / "checkout"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in ("mine.toml", "mine-keys.toml"):
            (work / entry.name).symlink_to(entry)
    return work


@pytest.mark.timeout(WALKTHROUGH_BOUND_S + 300)  # both blocks: the bound on the block, plus the own-database block
def test_the_readme_own_database_then_deployment_walkthroughs_run_as_written_in_one_shell_and_compose(
        fresh_home: Path, primary_database_url: str) -> None:
    assert (REPO / ".venv" / "bin" / "prefect").exists(), "the walkthrough runs .venv/bin/...: install as the README says"
    env, api = walkthrough_env(fresh_home)
    env["PINROTATE_DATABASE_URL"] = primary_database_url  # the own-database block's own server
    # The reader comes to the deployment block with no Prefect server yet (the own-database `run`
    # starts a temporary one of its own); the port the server will listen on is this test's choice,
    # which the block's `export PREFECT_API_URL=${PREFECT_API_URL:-...}` keeps.
    del env["PREFECT_API_URL"]
    both = f"{own_database_block()}\nPREFECT_API_URL={api}\n{walkthrough_block()}"
    proc = subprocess.Popen(["bash", "-eu", "-c", both], cwd=a_checkout_of_its_own(fresh_home), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=WALKTHROUGH_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"the walkthrough did not finish in {WALKTHROUGH_BOUND_S} s:\n{output[-6000:]}") from None
    pinrotate_home = fresh_home / ".pinrotate-deployment"
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
        # The deployment's runs started by hand (the own-database block's ad hoc run is in the same
        # ~/.prefect history, without a deployment).
        runs = db.execute("SELECT state_type, state_name FROM flow_run WHERE NOT auto_scheduled "
                          "AND deployment_id IS NOT NULL ORDER BY start_time").fetchall()
        (cancel_message,) = db.execute("SELECT message FROM flow_run_state WHERE type = 'CANCELLED' "
                                       "AND name = 'Cancelled'").fetchone()
        schedules = db.execute("SELECT active FROM deployment_schedule").fetchall()
    assert runs == [("CANCELLED", "Cancelled"), ("COMPLETED", "Completed")], runs
    assert schedules == [(0,)], schedules  # the stop step paused the schedule: no late runs at the next start
    assert re.match(r"stopped between batches; [1-9]\d* rows re-encrypted stay committed, [1-9]\d* left", cancel_message)

    # The own-database block ran first, on its own keyring: its gate opened, and the deployment's
    # sample and keyring were the preset's, not the own-database block's (key 2 promoted from 1).
    # (What tests/test_readme_own_database.py checked of the block run alone, now checked here,
    # where the same block runs as the reader's first: it ran the block a second time.)
    assert "gate for key 1: OPEN" in output and "key 2 is now current (was 1)" in output, output[-6000:]
    assert output.count("key 2 is now current (was 1)") == 2, output[-6000:]
    own = "seeded 2000 rows of the Pin profile sample under key 1"  # the deployment's sample is 10,000
    assert own in output, output[-6000:]
    own_part = output[output.index(own):output.index("seeded ", output.index(own) + len(own))]
    assert "gate for key 1: OPEN" in own_part, own_part[-6000:]  # the own database's gate, before the deployment
    assert "Traceback" not in output, output[-6000:]
    with psycopg.connect(primary_database_url) as conn:  # the own-database block's database, moved whole
        versions = dict(conn.execute("SELECT key_version, count(*) FROM profile.persons GROUP BY 1").fetchall())
    assert versions == {2: 1000}, versions
    assert (fresh_home / "checkout" / "mine.toml").exists()
    assert (fresh_home / "checkout" / "mine-keys.toml").exists() and (pinrotate_home / "keys.toml").exists()
    assert not (fresh_home / ".pinrotate" / "keys.toml").exists()

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
