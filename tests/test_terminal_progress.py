"""The progress display on an interactive terminal (contract §4): with stderr on a real
pseudo-terminal, ``run`` draws rows done of the backlog per target, the rate and the time left
(``rich.progress``), instead of a line per batch; without a TTY (or with ``--json``) nothing is
drawn and the plain log lines stay."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from tests.pinprofile import REPO, cli, seed_profile

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX pseudo-terminals")

ROWS = 120
JOB = {"batch_size": 10, "inter_batch_delay": 0.05}
ESCAPE = "\x1b["


def run_on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """``python -m flows.rotate ARGS`` with stderr on a pseudo-terminal of 120 columns (stdout a pipe,
    as in ``run > report.txt``); returns (exit code, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    shown: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "flows.rotate", *args], check=False, cwd=REPO,
                              env={**env, "TERM": "xterm-256color", "COLUMNS": "120"}, stdout=subprocess.PIPE,
                              stderr=slave, stdin=subprocess.DEVNULL, text=True, timeout=300)
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    return proc.returncode, proc.stdout, b"".join(shown).decode("utf-8", "replace")


def test_run_on_a_terminal_shows_rows_done_of_the_backlog_per_target_with_rate_and_time_left(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **JOB)
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    code, out, shown = run_on_a_terminal(["run", "--config", str(profile.config_path)], env)
    assert code == 0, shown[-4000:]
    assert ESCAPE in shown  # drawn, not printed line by line
    assert "rows/s" in shown and "left" in shown, shown[-4000:]
    # Each target's bar reaches its backlog: Person's 120 rows, PersonDocument's 60.
    assert "Person" in shown and f"{ROWS}/{ROWS}" in shown, shown[-4000:]
    assert f"{ROWS // 2}/{ROWS // 2}" in shown
    assert "event=batch_processed" not in shown  # the bar says it; no line per batch
    assert "event=job_completed" in shown  # the other lines still show, above the display
    assert "re-encrypted" in out  # the report on stdout, as always


def test_without_a_terminal_no_display_is_drawn_and_the_log_lines_stay(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=20, batch_size=10, inter_batch_delay=0)
    code, _, err = cli("run", "--config", str(profile.config_path), env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    assert ESCAPE not in err and "rows/s" not in err
    assert "event=batch_processed" in err


def test_the_gate_deep_pass_on_a_terminal_shows_rows_read_per_target(primary_database_url: str,
                                                                    tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **JOB)
    code, out, shown = run_on_a_terminal(["gate", "--retire", "1", "--config", str(profile.config_path)],
                                         dict(os.environ))
    assert code == 3, shown[-4000:]  # nothing moved yet: closed
    assert ESCAPE in shown and "deep pass" in shown and "rows/s" in shown, shown[-4000:]
    assert "Person" in shown and f"{ROWS}/{ROWS}" in shown, shown[-4000:]
    assert "gate for key 1: CLOSED" in out
