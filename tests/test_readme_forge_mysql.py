"""README's Forge on MySQL / MariaDB path, run as it is written: a database on the test MariaDB,
seed Forge's tables (examples/forge-mysql.sql) with values as Forge writes them and a sample Forge
bootstrap file, then inventory, a dry run, a run and the legacy gate.

The block after ``<!-- walkthrough: forge-mysql -->`` is handed to bash unchanged, in a folder of
its own that has the checkout's ``examples`` and ``.venv``, with a fresh ``HOME`` (the sample
bootstrap file is this test's own) and nothing of the shell's pinrotate, Forge or Prefect settings.
It names the machine's MariaDB (127.0.0.1:3306) and its database ``forge_demo``, dropped before
and after. Its gate sweeps the whole server: the test holds the shared server alone
(``shared_server_lock``, exclusive), rather than being ``server_wide``, which would run it on a
mariadbd of the worker's own, not on 127.0.0.1:3306.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pymysql
import pytest

from tests.conftest import shared_server_lock
from tests.mariadb_server import MariaDbServer
from tests.pinprofile import REPO
from tests.readme_blocks import readme_block

MARKER = "<!-- walkthrough: forge-mysql -->"
DATABASE = "forge_demo"


def forge_mysql_block() -> str:
    return readme_block(MARKER)


def _drop(server: MariaDbServer) -> None:
    with contextlib.closing(pymysql.connect(host=server.host, port=server.port, user=server.user,
                                            password=server.password, autocommit=True)) as conn, conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        # pinrotate's records about it live in the server's pinrotate database and outlive it
        # (docs/reference.md): a new forge_demo with new sample keys must not meet the last one's.
        for table in ("key_checks", "conflicts"):
            with contextlib.suppress(pymysql.err.ProgrammingError):
                cur.execute(f"DELETE FROM pinrotate.{table} WHERE database_name = %s", (DATABASE,))


@pytest.mark.mysql
def test_the_readme_forge_mysql_path_runs_as_written_and_ends_with_an_open_legacy_gate(
        shared_mariadb: MariaDbServer) -> None:
    mariadb = shared_mariadb
    if (mariadb.host, mariadb.port) != ("127.0.0.1", 3306) or shutil.which("mysql") is None:
        pytest.skip("the README's block names the machine's MariaDB on 127.0.0.1:3306 and its mysql client")
    assert (REPO / ".venv" / "bin" / "python").exists(), "the block runs .venv/bin/python: install as the README says"
    home = Path(tempfile.mkdtemp(prefix="pinrotate-forge-mysql-walk-"))
    work = home / "work"
    work.mkdir()
    (work / "examples").symlink_to(REPO / "examples")
    (work / ".venv").symlink_to(REPO / ".venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PINROTATE_", "VAULT_", "FORGE_", "PREFECT_"))}
    env.update(HOME=str(home))
    with shared_server_lock(f"mysql://{mariadb.host}:{mariadb.port}", exclusive=True):
        _drop(mariadb)
        try:
            proc = subprocess.run(["bash", "-eu", "-c", forge_mysql_block()], cwd=work, env=env, capture_output=True,
                                  text=True, timeout=600, check=False)
            sample = home / ".forge" / "secrets" / "crypto.properties"
            sample_mode = sample.stat().st_mode & 0o777 if sample.exists() else None
        finally:
            _drop(mariadb)
            shutil.rmtree(home, ignore_errors=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Traceback" not in output
    assert "seeded 221 rows of Forge's tables" in proc.stdout
    assert re.search(r"lowcode:crm_customer\s+350\s+0\s+150\s+0\s+200", proc.stdout), proc.stdout  # inventory
    assert "dry run" in proc.stdout
    assert re.search(r"lowcode:crm_customer\s+350\s+0\s+0\s+0", proc.stdout), proc.stdout  # the run: 350 values
    assert "gate for key legacy: OPEN" in proc.stdout, proc.stdout
    assert sample_mode == 0o600
