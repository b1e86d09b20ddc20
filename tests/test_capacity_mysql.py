"""Room for the new ciphertexts on MariaDB, on a server whose ``sql_mode`` is not strict: there a
value too long for its ``varchar(n)`` is not refused but silently cut to fit (a warning, no
error), which is what a legacy MySQL configuration still does. The capacity check BLOCKS such a
target before anything is written (inventory, run: exit 2); behind it, when the check is bypassed
(a scheme drained directly), the write's read-back finds the cut value: the batch rolls back and
that row is FAILED (``not_stored``), left as it was, the batch written again without it: nothing
is ever committed shortened. The same facts as tests/test_capacity.py proves on
PostgreSQL (whose varchar refuses instead). A mariadbd of this module's own (a server setting);
keys are random TEST keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pinrotate_core import rotation
from pinrotate_core.commands.mysql.run import drain
from pinrotate_core.commands.mysql.targets import resolve_mysql_target
from pinrotate_core.config import Settings
from pinrotate_core.drain import DrainOptions
from pinrotate_core.engines.mysql import connect as mysql_connect
from pinrotate_core.errors import ConfigError
from pinrotate_core.schemes.base import NOT_STORED
from pinrotate_core.schemes.fpc1_values import parse_fpc1
from pinrotate_core.schemes.registry import build_scheme
from tests.mariadb_server import MariaDbServer, start_own_server

from .test_fpc1_migration import K1, custom_settings, decrypt, fpc1, legacy_ecb, write_keys

pytestmark = pytest.mark.xdist_group("test_capacity_mysql")


@pytest.fixture(scope="module")
def lax_server() -> Iterator[MariaDbServer]:
    server = start_own_server(extra_args=["--sql-mode="])  # no STRICT_TRANS_TABLES: cuts, warns
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def lax_database(lax_server: MariaDbServer) -> Iterator[str]:
    with lax_server.fresh_database() as name:
        yield name


def _rows(server: MariaDbServer, database: str) -> list[tuple[Any, ...]]:
    with contextlib.closing(server.connect()) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT id, pw FROM `{database}`.creds ORDER BY id")
        return list(cur.fetchall())


def _creds(server: MariaDbServer, database: str) -> None:
    with contextlib.closing(server.connect()) as conn, conn.cursor() as cur:
        cur.execute("SELECT @@GLOBAL.sql_mode")
        assert cur.fetchone() == ("",)
        cur.execute(f"CREATE TABLE `{database}`.creds (id bigint PRIMARY KEY, pw varchar(70))")
        # 40 bytes of plaintext: 64 characters as legacy, 76 once FPC1:SM4 under k2. Row 2 would fit.
        cur.execute(f"INSERT INTO `{database}`.creds VALUES (1, %s), (2, %s)",
                    (legacy_ecb(b"x" * 40), fpc1("k1", K1, b"short")))
        conn.commit()
        # The server really cuts here: what the drain's write would meet.
        cur.execute(f"CREATE TEMPORARY TABLE `{database}`.cut (v varchar(3))")
        cur.execute(f"INSERT INTO `{database}`.cut VALUES ('abcdef')")
        cur.execute(f"SELECT v FROM `{database}`.cut")
        assert cur.fetchone() == ("abc",)


@pytest.fixture
def narrow(lax_server: MariaDbServer, lax_database: str, tmp_path: Path) -> Settings:
    """``creds`` made, a keyring whose current key is k2, and the fpc1 target's settings."""
    _creds(lax_server, lax_database)
    keys = tmp_path / "keys.toml"
    write_keys(keys)
    return custom_settings(lax_server.url(lax_database), keys, {"table": "creds", "columns": ["pw"]})


def test_a_target_too_narrow_is_blocked_before_anything_is_written_on_a_lax_server(
        lax_server: MariaDbServer, lax_database: str, narrow: Settings) -> None:
    settings = narrow
    before = _rows(lax_server, lax_database)
    inventory = rotation.inventory(settings).targets["T"]
    assert inventory.blocked_reason is not None and "70" in inventory.blocked_reason, inventory.as_dict()
    with pytest.raises(ConfigError, match="nothing was touched"):
        rotation.run_rotation(settings, expected_key="k2")
    assert _rows(lax_server, lax_database) == before


def test_a_value_the_server_would_cut_is_failed_and_left_as_it_was_when_the_check_is_bypassed(
        lax_server: MariaDbServer, lax_database: str, narrow: Settings) -> None:
    settings = narrow
    before = _rows(lax_server, lax_database)
    ctx = rotation.open_run(settings, expected_key="k2")
    try:
        keyring = rotation.read_current_key(ctx, announce=False)
        with mysql_connect.raw_connection(ctx.engine) as conn:  # resolved without the capacity check
            scheme = build_scheme(resolve_mysql_target(conn, settings.targets[0]), keyring, settings.keys,
                                  ctx.provider)
        result = drain(ctx.engine, scheme, DrainOptions(batch_size=100))
    finally:
        ctx.close()
    assert [(f.id, f.reason) for f in result.failed] == [("1", NOT_STORED)], (result.stopped, result.error)
    after = _rows(lax_server, lax_database)
    assert after[0] == before[0]  # as it was: the cut value was rolled back, never committed
    # The batch's other row, which fits, was written again without it: on k2, read back whole.
    assert result.reencrypted == 1 and parse_fpc1(after[1][1]).key_id == "k2" and decrypt(after[1][1]) == b"short"
