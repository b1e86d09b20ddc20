"""A real MariaDB for the tests: the machine's own on 127.0.0.1:3306 (root, no password) when it
answers, else a ``mariadbd`` of Debian's ``mariadb-server`` package started here on a free
loopback port, in a temporary data directory, with real authentication (root, no password, as
``mariadb-install-db --auth-root-authentication-method=normal`` makes it). Each test gets a fresh
database of its own, dropped at its end. Never touches a database it did not create.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymysql
import pytest

MACHINE_HOST = "127.0.0.1"
MACHINE_PORT = 3306
DATABASE_PREFIX = "pinrotate_test_"
START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class MariaDbServer:
    """Where a MariaDB answers, as root; ``process`` set when this module started it."""

    host: str
    port: int
    user: str = "root"
    password: str = ""
    process: subprocess.Popen[bytes] | None = None
    base_dir: Path | None = None
    created: set[str] = field(default_factory=set)

    @property
    def owned(self) -> bool:
        return self.process is not None

    def connect(self, database: str | None = None, *, autocommit: bool = True) -> pymysql.Connection:  # type: ignore[type-arg]
        return pymysql.connect(host=self.host, port=self.port, user=self.user, password=self.password,
                               database=database, autocommit=autocommit, connect_timeout=5, charset="utf8mb4")

    def url(self, database: str, scheme: str = "mysql") -> str:
        auth = f"{self.user}:{self.password}@" if self.password else f"{self.user}@"
        return f"{scheme}://{auth}{self.host}:{self.port}/{database}"

    def create_database(self) -> str:
        name = DATABASE_PREFIX + secrets.token_hex(6)
        with contextlib.closing(self.connect()) as conn, conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        self.created.add(name)
        return name

    def drop_database(self, name: str) -> None:
        with contextlib.closing(self.connect()) as conn, conn.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
            # pinrotate's records about it (the server's pinrotate database outlives it).
            for table in ("key_checks", "conflicts"):
                with contextlib.suppress(pymysql.err.ProgrammingError):
                    cur.execute(f"DELETE FROM pinrotate.{table} WHERE database_name = %s", (name,))
        self.created.discard(name)

    @contextlib.contextmanager
    def fresh_database(self) -> Iterator[str]:
        name = self.create_database()
        try:
            yield name
        finally:
            self.drop_database(name)

    def stop(self) -> None:
        for name in list(self.created):
            with contextlib.suppress(pymysql.Error):
                self.drop_database(name)
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None
        if self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self.base_dir = None


def machine_server(host: str = MACHINE_HOST, port: int = MACHINE_PORT) -> MariaDbServer | None:
    """The machine's MariaDB when it answers as root without a password, else None."""
    server = MariaDbServer(host, port)
    try:
        with contextlib.closing(server.connect()) as conn, conn.cursor() as cur:
            cur.execute("SELECT 1")
    except pymysql.Error:
        return None
    return server


def start_own_server(port: int | None = None, extra_args: Sequence[str] = ()) -> MariaDbServer:
    """A ``mariadbd`` of our own in a temporary data directory, on a free loopback port;
    ``extra_args`` for the daemon (e.g. ``--log-bin``, ``--server-id=2`` for a replication pair).

    Raises RuntimeError naming what is missing (run scripts/ensure-ops-tools.sh) or the server's
    own last log lines when it does not come up.
    """
    daemon, install_db = shutil.which("mariadbd", path=f"{os.environ.get('PATH', '')}:/usr/sbin"), shutil.which(
        "mariadb-install-db")
    if daemon is None or install_db is None:
        raise RuntimeError("mariadbd / mariadb-install-db not found: run scripts/ensure-ops-tools.sh "
                           "(installs Debian's mariadb-server)")
    base = Path(tempfile.mkdtemp(prefix="pinrotate-mariadb-"))
    datadir, sock, log = base / "data", base / "mariadb.sock", base / "error.log"
    # Its own tmpdir: with the shared /tmp, the bootstrap's temporary tables were once removed under it
    # ("Could not remove temporary table '/tmp/#sql-temptable-…'", then "Unknown table
    # 'mysql.tmp_user_sys'") while other servers of the suite ran beside it (CI, stop 36).
    tmpdir = base / "tmp"
    tmpdir.mkdir()
    as_root = ["--user=root"] if os.geteuid() == 0 else []  # mariadbd refuses root without it
    install = subprocess.run(
        [install_db, "--no-defaults", f"--datadir={datadir}", "--auth-root-authentication-method=normal",
         "--skip-test-db", f"--tmpdir={tmpdir}", *as_root], capture_output=True, timeout=120, check=False)
    if install.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"mariadb-install-db failed: {install.stderr.decode(errors='replace')[-500:]}")
    port = port or free_port()
    process = subprocess.Popen(
        [daemon, "--no-defaults", f"--datadir={datadir}", f"--socket={sock}", f"--port={port}",
         "--bind-address=127.0.0.1", f"--tmpdir={tmpdir}", f"--pid-file={base / 'mariadbd.pid'}", f"--log-error={log}",
         "--innodb-buffer-pool-size=32M", "--skip-name-resolve", *as_root, *extra_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = MariaDbServer("127.0.0.1", port, process=process, base_dir=base)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            with contextlib.closing(server.connect()) as conn, conn.cursor() as cur:
                cur.execute("SELECT 1")
            return server
        except pymysql.Error:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-800:] if log.exists() else "(no log)"
                server.stop()
                raise RuntimeError(f"mariadbd did not come up on port {port}: {tail}") from None
            time.sleep(0.1)


def mariadb_server() -> MariaDbServer:
    """The machine's MariaDB when it answers, else one of our own (stop() it at the end)."""
    return machine_server() or start_own_server()



# A module whose counts or gates are the whole server's (the gate's sweep, lock waits, marked
# sessions) takes a mariadbd of its own instead of holding the shared one alone: it imports these
# two, which then stand for conftest's ``mariadb`` and ``mysql_database`` in that module, and
# marks itself ``xdist_group`` (its tests on one worker, one server).
@pytest.fixture(scope="module", name="mariadb")
def private_mariadb() -> Iterator[MariaDbServer]:
    server = start_own_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="mysql_database")
def private_mysql_database(mariadb: MariaDbServer) -> Iterator[str]:
    with mariadb.fresh_database() as name:
        yield name


class MariaDbDatabase:
    """One fresh database of a test server, as the engine-neutral test adapters take it: its URL
    and statements with ``%s`` parameters, each on a connection of its own, committed."""

    def __init__(self, server: MariaDbServer, database: str) -> None:
        self.server, self.database = server, database
        self.url = server.url(database)

    def execute(self, statement: str, params: Sequence[Any] = ()) -> None:
        with contextlib.closing(self.server.connect(self.database)) as conn, conn.cursor() as cur:
            cur.execute(statement, tuple(params) or None)
