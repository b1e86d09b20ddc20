"""A run behind Debian's PgBouncer in ``pool_mode = transaction``, on a real PostgreSQL, with an
application using the same pool while it runs: nothing pinrotate sets outlives its own transaction
(every setting is a ``SET LOCAL``), so no application transaction ever runs with pinrotate's
``synchronous_commit``, timeouts or planner switches; and no server-side prepared statement is
made (a pooled server connection that never saw the PREPARE would fail the statement, SQLSTATE
26000). PgBouncer is started here, on a free loopback port in a temporary folder, pointing at the
test server (``bash scripts/ensure-ops-tools.sh`` installs it). Keys are random TEST keys made here.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pinrotate_core import rotation
from pinrotate_core.config import settings_from_mapping
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet

ROWS = 600
PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
# What an application transaction reads; pinrotate's drain sets each of these in its own transactions.
WATCHED = ("synchronous_commit", "statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout",
           "enable_hashjoin", "enable_mergejoin", "transaction_read_only", "session_replication_role")
_START_LIMIT_S = 30.0  # only stops a broken binary hanging the test; readiness is polled


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def pgbouncer_url(database_url: str, tmp_path: Path) -> Iterator[str]:
    """PgBouncer in transaction pooling in front of ``database_url``; its URL (same database and user)."""
    if not os.access(PGBOUNCER, os.X_OK):
        pytest.fail("pgbouncer is not installed: run `bash scripts/ensure-ops-tools.sh` (as root) first")
    info = conninfo_to_dict(database_url)
    # The application's defaults, as PgBouncer's server connections get them: synchronous_commit =
    # on even where the test server runs with it off, so that pinrotate's "off" would show.
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {info['dbname']} SET synchronous_commit = on")
    host, user, dbname = str(info.get("host") or "127.0.0.1"), str(info.get("user") or "postgres"), str(info["dbname"])
    port = _free_loopback_port()
    folder = tmp_path / "pgbouncer"
    folder.mkdir()
    ini = folder / "pgbouncer.ini"
    ini.write_text(f"""[databases]
{dbname} = host={host} port={info.get("port") or 5432} dbname={dbname} user={user}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = any
pool_mode = transaction
default_pool_size = 3
max_client_conn = 100
server_reset_query =
ignore_startup_parameters = extra_float_digits,options
""")
    command = [PGBOUNCER, str(ini)]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root: as the owner of the server's socket folder
        owner = pwd.getpwuid(os.stat(host).st_uid).pw_name if host.startswith("/") else "nobody"
        folder.chmod(0o755)
        ini.chmod(0o644)
        command[1:1] = ["-u", owner]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = make_conninfo(host="127.0.0.1", port=port, dbname=dbname, user=user)
    try:
        deadline = time.monotonic() + _START_LIMIT_S
        while True:
            try:
                with psycopg.connect(url, prepare_threshold=None, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if process.poll() is not None or time.monotonic() > deadline:
                    out = process.stdout.read().decode(errors="replace") if process.stdout else ""
                    pytest.fail(f"pgbouncer did not start: {out[-2000:]}")
                time.sleep(0.1)
        yield f"postgresql://{user}@127.0.0.1:{port}/{dbname}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_behind_pgbouncer_in_transaction_mode_the_application_never_sees_pinrotates_settings_and_the_run_succeeds(
        database_url: str, pg_conn: psycopg.Connection[Any], pgbouncer_url: str, keys_file: Path) -> None:
    provider = FileKeyProvider(keys_file, create=True)
    ciphers = AesGcmCipherSet(provider.load_keyring())
    pg_conn.execute("CREATE TABLE people (id bigint PRIMARY KEY, key_version integer NOT NULL, name_cipher bytea)")
    pg_conn.execute("CREATE TABLE app_events (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())")
    with pg_conn.transaction():
        pg_conn.cursor().executemany("INSERT INTO people VALUES (%s, 1, %s)",
                                     [(i, ciphers.encrypt_current(f"TEST name {i}".encode())) for i in range(1, ROWS + 1)])
    provider.add_key()
    provider.promote("2")
    keyring = provider.load_keyring()
    with psycopg.connect(pgbouncer_url, prepare_threshold=None) as probe:
        defaults = probe.execute("SELECT " + ", ".join(f"current_setting('{n}')" for n in WATCHED)).fetchone()
        probe.rollback()
    assert defaults is not None and defaults[0] == "on"

    seen: list[tuple[Any, ...]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def application() -> None:
        """Short transactions on the same pool for as long as the run lasts, each reading the settings it runs with."""
        try:
            with psycopg.connect(pgbouncer_url, prepare_threshold=None) as app:
                while not stop.is_set():
                    with app.transaction():
                        app.execute("INSERT INTO app_events DEFAULT VALUES")
                        row = app.execute("SELECT " + ", ".join(f"current_setting('{n}')" for n in WATCHED)).fetchone()
                    assert row is not None
                    seen.append(tuple(row))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    apps = [threading.Thread(target=application, daemon=True) for _ in range(3)]
    settings = settings_from_mapping({
        "database": {"url": pgbouncer_url},
        "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": 20, "inter_batch_delay": 0},
        "gate": {"wait": 5},
        "targets": [{"name": "People", "table": "people", "key_version": "key_version", "columns": ["name_cipher"]}],
    }, env={})
    for t in apps:
        t.start()
    try:
        report = rotation.run_rotation(settings)
    finally:
        stop.set()
        for t in apps:
            t.join(30)
    assert not errors, errors
    assert report.exit_code == 0, report.as_dict()
    result = report.targets["People"]
    assert result.reencrypted == ROWS and result.backlog_remaining == 0 and result.batches >= ROWS // 20
    assert len(seen) > 50, "the application ran too few transactions beside the run to tell"
    assert set(seen) == {tuple(defaults)}, [s for s in seen if s != tuple(defaults)][:5]
    assert {int(kv) for (kv,) in pg_conn.execute("SELECT key_version FROM people")} == {2}
    assert all(AesGcmCipherSet(keyring).cipher("2").decrypt(bytes(blob)) == f"TEST name {i}".encode()
               for i, blob in pg_conn.execute("SELECT id, name_cipher FROM people"))
