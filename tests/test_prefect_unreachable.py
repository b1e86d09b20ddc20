"""A Prefect API that cannot be reached is one line, exit 4 (contract §4): the state the README's
deployment block leaves a shell in (``PREFECT_API_URL`` exported, the server stopped). The line
names the URL and the two ways on; never a traceback; ``--json`` prints ``{"error", "exit_code"}``.
"""

from __future__ import annotations

import socket
from pathlib import Path

from tests.pinprofile import cli_all, seed_profile


def stopped_server_url() -> str:
    """The URL of a Prefect server that is not running: a port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/api"


def test_run_against_a_stopped_prefect_server_is_one_line_naming_the_url_and_exit_4(
        primary_database_url: str, tmp_path: Path) -> None:
    # A start that would otherwise go ahead (database, keyring and targets fine): the only thing
    # wrong is the server behind PREFECT_API_URL. (A bad configuration or target answers first, exit 2:
    # test_cli's missing table.)
    profile = seed_profile(primary_database_url, tmp_path, rows=5)
    config = profile.config_path
    keyring_before = profile.keys_file.read_bytes()
    url = stopped_server_url()
    (code, doc, err), (text_code, text, text_err) = cli_all(
        [["run", "--config", str(config), "--json"], ["run", "--config", str(config)]],
        env={"PREFECT_API_URL": url})
    assert code == 4 and doc["exit_code"] == 4, err
    assert set(doc) == {"error", "exit_code"}
    assert url in doc["error"] and "unset PREFECT_API_URL" in doc["error"] and "start that server" in doc["error"]
    assert text_code == 4 and text == ""
    lines = [line for line in text_err.splitlines() if line.strip()]
    assert lines == [f"pinrotate: error: {doc['error']}"], text_err
    assert "Traceback" not in err + text_err
    # Nothing was run: every row still on key 1, the keyring as it was.
    assert profile.key_versions("persons") == {1: 5} and profile.keys_file.read_bytes() == keyring_before
