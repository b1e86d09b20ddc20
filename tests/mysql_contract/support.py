"""What the MySQL acceptance tests share: connections of their own (PyMySQL, as an application
has), SQL files, configuration and keyring files written as a user writes them, the CLI, and a
watch on lock waits. Nothing here imports pinrotate: the tests see it only through its CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import pymysql
import pymysql.constants.CLIENT
import tomli_w

from tests.mariadb_server import MariaDbServer
from tests.pinprofile import REPO

from .codecs import b64

EXAMPLES = REPO / "examples"
HERE = Path(__file__).resolve().parent
Row = tuple[Any, ...]


# --- connections and SQL -----------------------------------------------------------------------------


def connect(server: MariaDbServer, database: str | None, *, autocommit: bool = True,
            multi: bool = False) -> pymysql.Connection:
    return pymysql.connect(host=server.host, port=server.port, user=server.user, password=server.password,
                           database=database, autocommit=autocommit, connect_timeout=5, charset="utf8mb4",
                           client_flag=pymysql.constants.CLIENT.MULTI_STATEMENTS if multi else 0)


def run_sql_file(server: MariaDbServer, database: str, path: Path) -> None:
    """The whole file in one go, as ``mysql forge < file.sql`` runs it."""
    with contextlib.closing(connect(server, database, multi=True)) as conn, conn.cursor() as cur:
        cur.execute(path.read_text(encoding="utf-8"))
        while cur.nextset():
            pass


def query(conn: pymysql.Connection, sql: str, args: Sequence[Any] | Mapping[str, Any] = ()) -> list[Row]:
    """Rows of ``sql``; without ``args`` the text is sent as it is (a '%' in it is no placeholder)."""
    with conn.cursor() as cur:
        cur.execute(sql, args or None)
        return list(cur.fetchall())


def is_mariadb(conn: pymysql.Connection) -> bool:
    return "mariadb" in str(query(conn, "SELECT VERSION()")[0][0]).lower()


# --- files a user writes -----------------------------------------------------------------------------


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def write_private(path: Path, text: str, encoding: str = "utf-8") -> Path:
    private_dir(path.parent)
    path.write_text(text, encoding=encoding)
    path.chmod(0o600)
    return path


def write_toml(path: Path, doc: Mapping[str, Any]) -> Path:
    path.write_text(tomli_w.dumps(dict(doc)), encoding="utf-8")
    return path


def file_keyring(path: Path, current: str | int, keys: Mapping[Any, bytes], legacy: bytes | None = None) -> Path:
    """A ``file`` provider keyring (contract §3): ``current``, ``[keys]`` and, for fpc1, ``legacy``."""
    doc: dict[str, Any] = {"current": current}
    if legacy is not None:
        doc["legacy"] = b64(legacy)
    doc["keys"] = {str(k): b64(v) for k, v in keys.items()}
    return write_private(path, tomli_w.dumps(doc))


def forge_bootstrap(path: Path, active: str, keys: Mapping[str, bytes], legacy: bytes) -> Path:
    """Forge's own bootstrap properties file (crypto.properties), as a Forge operator has it:
    write-versioned on, legacy values read with the legacy key."""
    lines = ["forge.crypto.persistence.enabled=true",
             "forge.crypto.persistence.write-versioned=true",
             "forge.crypto.persistence.legacy-read-enabled=true",
             f"forge.crypto.persistence.active-key-id={active}",
             f"forge.crypto.persistence.active-key={b64(keys[active])}",
             *(f"forge.crypto.persistence.keys.{k}={b64(v)}" for k, v in keys.items() if k != active),
             f"forge.crypto.persistence.legacy-key={b64(legacy)}"]
    return write_private(path, "\n".join(lines) + "\n", encoding="latin-1")


# --- the command line --------------------------------------------------------------------------------

_FOREIGN_SETTINGS = ("PINROTATE_", "FORGE_", "VAULT_", "PREFECT_API_")


def rotate(*args: str, prefect_api: str | None = None, timeout: float = 300) -> tuple[int, Any, str]:
    """``python -m flows.rotate ARGS`` as a user runs it: (exit code, the ``--json`` document or
    stdout, stderr). The shell's own pinrotate / Forge / Vault / Prefect API settings are left out;
    ``prefect_api`` is the test Prefect server for commands that run the flow."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_SETTINGS)}
    if prefect_api is not None:
        env["PREFECT_API_URL"] = prefect_api
    proc = subprocess.run([sys.executable, "-m", "flows.rotate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    out: Any = proc.stdout
    if "--json" in args:
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        assert len(lines) == 1, f"--json must print one JSON document on stdout, got {proc.stdout!r}\n{proc.stderr}"
        out = json.loads(lines[0])
    return proc.returncode, out, proc.stderr


def start_rotate(*args: str, prefect_api: str) -> subprocess.Popen[str]:
    """``rotate`` started in the background (for what the application does meanwhile)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_SETTINGS)}
    env["PREFECT_API_URL"] = prefect_api
    return subprocess.Popen([sys.executable, "-m", "flows.rotate", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, Any, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"--json must print one JSON document on stdout, got {out!r}\n{err}"
    return proc.returncode, json.loads(lines[0]), err


def one_line_error(code: int, doc: Any, err: str, expected: int) -> str:
    """A refusal as contract §4 describes it: the exit code, one line on stderr, and with
    ``--json`` exactly ``{"error", "exit_code"}`` on stdout. Returns the line."""
    assert code == expected, (code, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    assert isinstance(doc, dict) and set(doc) == {"error", "exit_code"}, doc
    assert doc["exit_code"] == expected and doc["error"] and "\n" not in doc["error"]
    assert doc["error"] in lines[0]
    return lines[0]


# --- the application's locks -------------------------------------------------------------------------

_MARIADB_WAITS = (
    "SELECT r.trx_mysql_thread_id, TIMESTAMPDIFF(MICROSECOND, r.trx_wait_started, NOW(6)) / 1000000"
    " FROM information_schema.INNODB_LOCK_WAITS w"
    " JOIN information_schema.INNODB_TRX r ON r.trx_id = w.requesting_trx_id"
    " JOIN information_schema.INNODB_TRX b ON b.trx_id = w.blocking_trx_id"
    " WHERE b.trx_mysql_thread_id = %s")
_MYSQL_WAITS = "SELECT waiting_pid, wait_age_secs FROM sys.innodb_lock_waits WHERE blocking_pid = %s"


class LockWaitWatch:
    """Samples, from a session of its own, every transaction waiting on a lock that the session
    ``blocker`` (a connection id) holds: who waited and the longest wait seen, in seconds.
    ``information_schema.INNODB_TRX`` is refreshed at most every 0.1 s and ``trx_wait_started``
    has whole seconds: a bound read from it is good to about a second."""

    def __init__(self, server: MariaDbServer, blocker: int, interval: float = 0.05) -> None:
        self._conn = connect(server, None)
        self._sql = _MARIADB_WAITS if is_mariadb(self._conn) else _MYSQL_WAITS
        self._blocker, self._interval = blocker, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lock-wait-watch", daemon=True)
        self.waiters: set[int] = set()
        self.longest = 0.0
        self.samples = 0

    def _watch(self) -> None:
        while not self._stop.is_set():
            for waiter, age in query(self._conn, self._sql, (self._blocker,)):
                self.waiters.add(int(waiter))
                self.longest = max(self.longest, float(age or 0))
            self.samples += 1
            time.sleep(self._interval)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._conn.close()


@contextlib.contextmanager
def application(server: MariaDbServer, database: str) -> Iterator[pymysql.Connection]:
    """The application's own session (autocommit until it says BEGIN), closed at the end: an open
    transaction of it is rolled back by the server then."""
    conn = connect(server, database)
    try:
        yield conn
    finally:
        conn.close()
