"""Faster ad hoc runs (issue 33, point 7): at a terminal, the first ``run`` without
``PREFECT_API_URL`` starts a Prefect server that the next runs reuse, and that stops by itself once
unused; outside a terminal (scripts, CI) each run keeps its temporary server and nothing outlives
the command. Driven as a person runs it: stderr on a real pseudo-terminal, real processes, the
server's own API for the run history."""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.pinprofile import cli, seed_profile
from tests.prefect_home import migrated_prefect_home
from tests.test_terminal_progress import run_on_a_terminal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX pseudo-terminals, /proc")

IDLE_S = 30  # long enough for the gap between two runs on a loaded machine; the test waits it out once


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def flow_runs_of(url: str, config: Path) -> list[dict[str, Any]]:
    request = urllib.request.Request(f"{url}/flow_runs/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        runs = json.loads(r.read())
    return [run for run in runs if run["parameters"].get("config_path") == str(config)]


def test_runs_at_a_terminal_share_one_prefect_server_that_stops_once_unused(
        primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=30, batch_size=10, inter_batch_delay=0)
    config = str(profile.config_path)
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("PINROTATE_PREFECT_SERVER", "PREFECT_API_URL")}
    env.update(PINROTATE_HOME=str(home), PREFECT_HOME=migrated_prefect_home(tmp_path / "prefect"),
               PINROTATE_PREFECT_SERVER_IDLE=str(IDLE_S))
    state_file = home / "prefect-server" / "server.json"
    keeper = None
    try:
        # Outside a terminal (the default of scripts and schedulers): a temporary server, and nothing
        # of it is left once the command has returned.
        code, doc, err = cli("run", "--config", config, "--json", env=env)
        assert code == 0, err
        assert doc["targets"]["Person"]["reencrypted"] == 30
        assert not state_file.exists() and "stays up" not in err
        first_run = doc["run_id"]

        # At a terminal: the run starts the shared server, says so, and leaves it running.
        code, out, shown = run_on_a_terminal(["run", "--config", config], env)
        assert code == 0, shown[-4000:]
        assert "gate for key 1" in out  # the report on stdout, as always
        state = json.loads(state_file.read_text())
        keeper, url = state["pid"], state["url"]
        assert f"the Prefect server of ad hoc runs stays up for the next run at {url}" in shown, shown[-3000:]
        assert f"process {keeper}" in shown and "30 s unused" in shown
        assert running(keeper) and answers(url)

        # The next run (here asked for by name, without a terminal) reuses it: no new server, no note.
        code, doc, err = cli("run", "--config", config, "--json", env={**env, "PINROTATE_PREFECT_SERVER": "reuse"})
        assert code == 0, err
        assert "stays up" not in err
        assert json.loads(state_file.read_text())["pid"] == keeper
        # Run history as before: Prefect's database under PREFECT_HOME, one for both kinds of
        # server; all three runs are in it, completed.
        runs = flow_runs_of(url, profile.config_path)
        assert len(runs) == 3 and {r["state_type"] for r in runs} == {"COMPLETED"}, runs
        assert {first_run, doc["run_id"]} <= {r["id"] for r in runs}

        # Unused for IDLE_S seconds, it stops by itself, server and keeper, and is forgotten.
        deadline = time.monotonic() + IDLE_S + 90
        while running(keeper) and time.monotonic() < deadline:
            time.sleep(1)
        assert not running(keeper), "the shared server's keeper did not stop once unused"
        assert not state_file.exists()
        assert not answers(url)
        keeper = None
    finally:
        if keeper is not None and running(keeper):
            os.kill(keeper, 15)


def test_an_unknown_server_choice_is_refused_in_one_line(primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=3)
    code, doc, err = cli("run", "--config", str(profile.config_path), "--json",
                         env={"PINROTATE_PREFECT_SERVER": "shared"})
    assert code == 2, err
    assert doc == {"error": "PINROTATE_PREFECT_SERVER='shared': must be reuse or temporary", "exit_code": 2}
    assert "Traceback" not in err
    assert profile.key_versions("persons") == {1: 3}  # nothing ran


def test_a_run_refused_at_the_terminal_says_one_line_and_leaves_no_server_behind(tmp_path: Path) -> None:
    # The shared server is asked for before the run's checks (its start-up overlaps them); a run
    # they refuse (here: no database answers) must still be one line, and the server it started,
    # never used, must go.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "pinrotate.toml"
    keys = tmp_path / "keys.toml"
    keys.write_text('current = "1"\n[keys]\n1 = "' + base64.b64encode(secrets.token_bytes(32)).decode() + '"\n')
    keys.chmod(0o600)  # a TEST key made here
    config.write_text(f'[database]\nurl = "postgresql://app@127.0.0.1:{port}/profile"\n'
                      f'[keys]\nprovider = "file"\nfile = "{keys}"\n'
                      '[[targets]]\nname = "Person"\ntable = "profile.persons"\nid = "id"\n'
                      'columns = ["first_name_cipher"]\nkey_version = "key_version"\n')
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PINROTATE_HOME=str(home), PREFECT_HOME=str(tmp_path / "prefect"), PINROTATE_PREFECT_SERVER="reuse")
    code, _, err = cli("run", "--config", str(config), env=env)
    assert code == 4, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pinrotate: error: cannot connect to database"), err
    state_file = home / "prefect-server" / "server.json"
    deadline = time.monotonic() + 60
    while state_file.exists():
        assert time.monotonic() < deadline, f"the unused server was left running: {state_file.read_text()}"
        time.sleep(0.2)
