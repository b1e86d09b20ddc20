"""README's Forge path, run as it is written: seed Forge's tables with values as Forge writes them
and a sample Forge bootstrap file, then inventory, a dry run, a run and the legacy gate.

The block after ``<!-- walkthrough: forge -->`` is handed to bash unchanged, in a folder of its own
that has the checkout's ``examples`` and ``.venv``, with a fresh ``HOME`` (so ``~/.pinrotate``, the
embedded PostgreSQL and the sample bootstrap file are this test's own) and nothing of the shell's
pinrotate, Forge or Prefect settings.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.pinprofile import REPO
from tests.readme_blocks import readme_block

MARKER = "<!-- walkthrough: forge -->"


def forge_block() -> str:
    return readme_block(MARKER)


def test_the_readme_forge_path_runs_as_written_and_ends_with_an_open_legacy_gate() -> None:
    assert (REPO / ".venv" / "bin" / "python").exists(), "the block runs .venv/bin/python: install as the README says"
    # Outside pytest's basetemp, as conftest's own embedded PostgreSQL: the server runs unprivileged.
    home = Path(tempfile.mkdtemp(prefix="pinrotate-forge-walk-"))
    home.chmod(0o755)
    work = home / "work"
    work.mkdir()
    (work / "examples").symlink_to(REPO / "examples")
    (work / ".venv").symlink_to(REPO / ".venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PINROTATE_", "VAULT_", "FORGE_", "PREFECT_"))}
    env.update(HOME=str(home), PREFECT_HOME=str(home / ".prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    try:
        proc = subprocess.run(["bash", "-eu", "-c", forge_block()], cwd=work, env=env, capture_output=True, text=True,
                              timeout=900, check=False)
        sample = home / ".pinrotate" / "forge-sample" / "crypto.properties"
        sample_mode = sample.stat().st_mode & 0o777 if sample.exists() else None
    finally:
        shutil.rmtree(home, ignore_errors=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Traceback" not in output
    assert "seeded 221 rows of Forge's tables" in proc.stdout
    assert re.search(r"lowcode:crm_customer\s+350\s+0\s+150\s+0\s+200", proc.stdout)  # inventory before the run
    assert "dry run" in proc.stdout
    assert re.search(r"lowcode:crm_customer\s+350\s+0\s+0\s+0", proc.stdout)  # the run: 350 values, none failed
    assert "gate for key legacy: OPEN" in proc.stdout
    assert sample_mode == 0o600
