"""README's "Trying it on your own database", run as it is written: copy the example configuration,
seed the sample, add and promote a key, inventory, run, gate.

The block after ``<!-- walkthrough: own-database -->`` is handed to bash unchanged, in a folder of
its own that has the checkout's ``examples`` and ``.venv``, with ``PINROTATE_DATABASE_URL`` naming a
fresh database (as the block's first comment offers) and a fresh ``PINROTATE_HOME`` for the keyring.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import psycopg
import pytest

from tests.pinprofile import REPO

MARKER = "<!-- walkthrough: own-database -->"


def own_database_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(re.escape(MARKER) + r"\s*```sh\n(.*?)\n```", text, re.DOTALL)
    assert match, f"README.md has no ```sh block after {MARKER}"
    return match.group(1)


@pytest.mark.slow
def test_the_readme_own_database_steps_run_as_written_and_end_with_an_open_gate(
        primary_database_url: str, tmp_path: Path) -> None:
    assert (REPO / ".venv" / "bin" / "python").exists(), "the block runs .venv/bin/python: install as the README says"
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(REPO / "examples")
    (work / ".venv").symlink_to(REPO / ".venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PINROTATE_", "VAULT_"))}
    env.update(PINROTATE_DATABASE_URL=primary_database_url, PINROTATE_HOME=str(tmp_path / "home"),
               HOME=str(tmp_path))
    proc = subprocess.run(["bash", "-eu", "-c", own_database_block()], cwd=work, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Traceback" not in output
    assert "seeded 2000 rows of the Pin profile sample under key 1" in proc.stdout
    assert "gate for key 1: OPEN" in proc.stdout
    with psycopg.connect(primary_database_url) as conn:
        versions = dict(conn.execute("SELECT key_version, count(*) FROM profile.persons GROUP BY 1").fetchall())
    assert versions == {2: 1000}
    assert (work / "mine.toml").exists()
