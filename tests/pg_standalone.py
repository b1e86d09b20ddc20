"""A second, standalone PostgreSQL for settings the shared test server lacks (prepared transactions).

``max_prepared_transactions`` needs a restart, so the session's embedded server keeps its 0; this
one is made with the wheel's ``initdb`` in a temporary folder, listens on its own unix socket only,
and is stopped and removed at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from .pg_replica import _bin, _run_as_server_user

STANDALONE_PORT = 5434  # on its own socket folder: never a TCP port


@contextlib.contextmanager
def start_standalone(**settings: str) -> Iterator[str]:
    """A fresh cluster started with ``settings`` (``-c name=value``); yields its admin URL."""
    root = Path(tempfile.mkdtemp(prefix="pinrotate-pg2-"))
    data_dir = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "embedded_postgres", "embedded_postgres")
    root.chmod(0o755)
    options = f'-h "" -k {root} -p {STANDALONE_PORT} -c fsync=off ' + " ".join(
        f"-c {name}={value}" for name, value in settings.items())
    try:
        _run_as_server_user([_bin("initdb"), "-D", str(data_dir), "-U", "postgres", "--auth=trust",
                             "--encoding=UTF8", "--no-sync"])
        _run_as_server_user([_bin("pg_ctl"), "-D", str(data_dir), "-w", "-l", str(root / "log"), "-o", options,
                             "start"])
        yield f"postgresql://postgres@/postgres?host={quote(str(root))}&port={STANDALONE_PORT}"
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _run_as_server_user([_bin("pg_ctl"), "-D", str(data_dir), "-m", "immediate", "-w", "stop"])
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_prepared_server() -> Iterator[str]:
    """Admin URL of a standalone server with ``max_prepared_transactions = 4`` (started on first use)."""
    with start_standalone(max_prepared_transactions="4") as url:
        yield url
