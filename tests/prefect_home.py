"""A private ``PREFECT_HOME`` whose Prefect database is already migrated.

A Prefect server on a new ``PREFECT_HOME`` first runs every migration of its SQLite database:
about 7 s of CPU, more than the rest of its start. Tests that give a server a home of their own
(so that its run history is theirs alone) need an empty history, not the migrations: they take a
copy of one database migrated once per machine and Prefect version (made under a lock, with
``prefect server database upgrade``). The walkthroughs of the README keep a fresh ``HOME``, as a
new user has: they are what proves the migrations on a first run.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

_TEMPLATE = Path(tempfile.gettempdir()) / f"pinrotate-test-prefect-db-{version('prefect')}-py{sys.version_info[0]}{sys.version_info[1]}"


def _template() -> Path:
    database = _TEMPLATE / "prefect.db"
    with open(f"{_TEMPLATE}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not database.exists():
            building = Path(tempfile.mkdtemp(prefix=_TEMPLATE.name + "-"))
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            env.update(PREFECT_HOME=str(building), PREFECT_SERVER_ANALYTICS_ENABLED="false")
            subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env,
                           check=True, capture_output=True, timeout=300)
            with sqlite3.connect(building / "prefect.db") as db:  # everything in the one file
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            _TEMPLATE.mkdir(exist_ok=True)
            os.replace(building / "prefect.db", database)
            shutil.rmtree(building, ignore_errors=True)
    return database


def migrated_prefect_home(home: Path) -> str:
    """``home`` (created) holding a migrated, empty Prefect database; its path as text, for ``PREFECT_HOME``."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_template(), home / "prefect.db")
    return str(home)
