"""An unreachable database (issue 9 point 7, contract §4): one line naming host, port, database and
user, never a password, with the server's reason; exit 4 for every command; ``--json`` prints one
``{"error", "exit_code"}`` document; no traceback anywhere, even from SQLAlchemy's pool.

Every case runs against a real server: a loopback port nobody listens on, the test server with a
database or role that does not exist, and an embedded server of this module stopped mid-run.
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import load_settings
from pinrotate_core.db import make_engine
from pinrotate_core.engines.postgresql.connect import database_identity, raw_connection
from pinrotate_core.errors import DatabaseUnavailable
from tests.pinprofile import cli_all, seed_profile, write_config

# xdist: every test of this module on one worker (one embedded PostgreSQL of the module's own, stopped by its tests).
pytestmark = pytest.mark.xdist_group("test_db_errors")

PASSWORD = "Pw-not-to-be-shown-31f9"
COMMANDS = (["inventory"], ["gate", "--retire", "1"], ["run"])


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _with(url: str, *, user: str | None = None, database: str | None = None) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}:{PASSWORD}@{netloc.rsplit('@', 1)[-1]}"
    path = f"/{database}" if database is not None else parts.path
    return urlunsplit((parts.scheme, netloc, path, parts.query, parts.fragment))


def _assert_one_line_exit_4(commands: tuple[list[str], ...], config: Path, *named: str) -> None:
    """Every command, with and without ``--json``: each its own process, all started together
    (none of them reaches the database, so none can change what another sees)."""
    runs = [(args, json_flag) for args in commands for json_flag in ([], ["--json"])]
    results = cli_all([[*args, "--config", str(config), *json_flag] for args, json_flag in runs])
    for (args, json_flag), (code, out, err) in zip(runs, results, strict=True):
        assert code == 4, (args, json_flag, err)
        assert "Traceback" not in err and PASSWORD not in err and PASSWORD not in str(out)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("pinrotate: error: cannot connect to database"), err
        for part in named:
            assert part in lines[0], (part, lines[0])
        if json_flag:
            assert out == {"error": lines[0].removeprefix("pinrotate: error: "), "exit_code": 4}
        else:
            assert out == ""


@pytest.fixture
def keyring_file(tmp_path: Path) -> Path:
    from pinrotate_core.providers.file import FileKeyProvider

    path = tmp_path / "keys" / "keys.toml"
    provider = FileKeyProvider(path, create=True)
    provider.load_keyring()
    # Key 2 current, key 1 retirable: the gate gets past its key check and reaches the database.
    provider.add_key()
    provider.promote("2")
    return path


def test_a_port_nobody_listens_on_is_one_line_and_exit_4_for_every_command(tmp_path: Path,
                                                                           keyring_file: Path) -> None:
    port = _free_loopback_port()
    config = write_config(tmp_path / "p.toml", f"postgresql://app:{PASSWORD}@127.0.0.1:{port}/profile", keyring_file)
    _assert_one_line_exit_4(COMMANDS, config, '"profile"', f"127.0.0.1:{port}", 'user "app"', "Connection refused")


def test_a_database_that_does_not_exist_is_named_with_the_servers_reason(
        primary_database_url: str, tmp_path: Path, keyring_file: Path) -> None:
    url = _with(primary_database_url, database="no_such_database_x")
    config = write_config(tmp_path / "p.toml", url, keyring_file)
    _assert_one_line_exit_4(COMMANDS, config, '"no_such_database_x"', 'database "no_such_database_x" does not exist')


def test_a_role_that_does_not_exist_is_named_with_the_servers_reason(
        primary_database_url: str, tmp_path: Path, keyring_file: Path) -> None:
    url = _with(primary_database_url, user="no_such_role_x")
    config = write_config(tmp_path / "p.toml", url, keyring_file)
    _assert_one_line_exit_4(COMMANDS, config, 'user "no_such_role_x"', "no_such_role_x")


def test_a_wrong_user_is_not_retried_but_an_outage_is(primary_database_url: str) -> None:
    for url, retryable in ((_with(primary_database_url, user="no_such_role_x"), False),
                           (f"postgresql://app@127.0.0.1:{_free_loopback_port()}/profile", True)):
        engine = make_engine(url, pool_size=1)
        try:
            with pytest.raises(DatabaseUnavailable) as err, raw_connection(engine):
                pass
        finally:
            engine.dispose()
        assert err.value.retryable is retryable and "\n" not in str(err.value)


# --- a server that goes away mid-run ------------------------------------------------------------


@pytest.fixture(scope="module")
def doomed_server() -> Iterator[Any]:
    """An embedded PostgreSQL of this module alone, so that stopping it harms no other test."""
    from pinrotate_core.engines.postgresql.connect import embedded_server

    folder = Path(tempfile.mkdtemp(prefix="pinrotate-doomed-"))
    server = embedded_server(folder / "data", cleanup_mode="delete")  # one start at a time, machine-wide
    try:
        yield server
    finally:
        server.cleanup()


def test_a_server_stopped_mid_run_stops_fail_closed_without_a_traceback(
        doomed_server: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    url = doomed_server.get_uri("postgres")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE profile_doomed")
    url = _with(url, database="profile_doomed")
    profile = seed_profile(url, tmp_path, rows=60, batch_size=10, inter_batch_delay=0)
    settings = load_settings(profile.config_path, env={})

    ctx = rotation.open_run(settings)
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        stopped = []

        def stop_the_server(event: Any) -> None:
            if not stopped:
                stopped.append(True)
                doomed_server.cleanup()  # pg_ctl stop (fast): every session is cut off

        first = ctx.targets[0].name
        result = rotation.drain(ctx, first, on_batch=stop_the_server)
        assert stopped and result.stopped == "db_error"
        assert 0 < result.reencrypted < 60
        with pytest.raises(DatabaseUnavailable) as err:
            rotation.verify(ctx, {first: result})
        assert "\n" not in str(err.value) and "cannot connect to database \"profile_doomed\"" in str(err.value)
    finally:
        ctx.close()
    assert "Traceback" not in capfd.readouterr().err

    # The server stays down: every command answers with one line and exit 4.
    _assert_one_line_exit_4(COMMANDS, profile.config_path, '"profile_doomed"')


def test_the_database_identity_names_the_server_address_without_a_netmask(database_url: str) -> None:
    # The gate record's server_address: inet_server_addr()::text gave "127.0.0.1/32".
    engine = make_engine(database_url, pool_size=1)
    try:
        identity = database_identity(engine)
    finally:
        engine.dispose()
    if identity["server_address"] is None:
        pytest.skip("connected over a unix socket: no server address (the TCP server runs this test)")
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT inet_server_addr()::text").fetchone()
    assert row is not None and "/" in row[0]  # what the server's own text form carries
    assert identity["server_address"] == row[0].split("/")[0]
