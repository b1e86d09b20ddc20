"""Who may start a rotation: a Prefect server with API authentication, as the reference documents it.

A real ``prefect server start`` with ``PREFECT_SERVER_API_AUTH_STRING``: a client without the same
``PREFECT_API_AUTH_STRING`` can neither start a run nor edit the throttle Variable, and is told so
in one line; with it, the run goes through and is recorded on that server.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pinprofile import cli, seed_profile
from tests.prefect_home import migrated_prefect_home

# xdist: every test of this module on one worker (one authenticated prefect server for the module).
pytestmark = [pytest.mark.deployment, pytest.mark.xdist_group("test_prefect_auth")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def authed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(API URL, auth string) of a Prefect server that demands Basic authentication."""
    home = tmp_path_factory.mktemp("prefect-auth-home")
    port = _free_port()
    auth = f"admin:{secrets.token_urlsafe(12)}"  # a throwaway test credential
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=migrated_prefect_home(home), PREFECT_SERVER_API_AUTH_STRING=auth,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_UI_ENABLED="false")
    log = (home / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (home / "server.log").read_text()
            assert time.monotonic() < deadline, "the Prefect server did not start"
            time.sleep(0.5)
        yield url, auth
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _api(url: str, auth: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(f"{url}/{path}", data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json",
        "Authorization": "Basic " + base64.b64encode(auth.encode()).decode()})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def _prefect(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefect", *args], check=False, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_without_the_servers_auth_string_nobody_starts_a_run_or_edits_the_throttle(
        primary_database_url: str, tmp_path: Path, authed_server: tuple[str, str]) -> None:
    url, auth = authed_server
    profile = seed_profile(primary_database_url, tmp_path, rows=20)
    intruder = {"PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": "admin:wrong"}

    code, _, err = cli("run", "--config", str(profile.config_path), env=intruder)
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"the Prefect API at {url} refused the credentials (HTTP 401)" in last
    assert "PREFECT_API_AUTH_STRING" in last and auth not in err
    assert profile.key_versions("persons") == {1: 20}  # nothing ran

    edit = _prefect("variable", "set", "pinrotate_throttle", '{"paused": true}', env=intruder)
    assert edit.returncode != 0 and "401" in edit.stdout + edit.stderr

    # The same server, with the server's string on the client: the run goes through and is recorded.
    allowed = {"PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": auth}
    code, report, err = cli("run", "--config", str(profile.config_path), "--json", env=allowed)
    assert code == 0, err
    assert report["targets"]["Person"]["reencrypted"] == 20
    runs = _api(url, auth, "flow_runs/filter", {"flows": {"name": {"any_": ["pinrotate-rotate"]}}})
    assert [r["state_type"] for r in runs] == ["COMPLETED"]
