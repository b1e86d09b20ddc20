"""All or nothing per key reaches past a drain's own slice (contract §2), on PostgreSQL and MariaDB.

An ``fpc1`` value has no tag: a value under a wrong key is caught only by its padding. So a key
one of whose values fails is held back for the whole run, and the pre-pass that finds it reads
the whole target: every tenant and every shard's ids, not only the rows the drain itself may
write. A shard whose own values all pass, or a ``--tenant`` run whose tenant's values all pass,
must still rewrite nothing under a key whose failing value lies in another shard or tenant; the
failing row is listed by the drain whose rows it is.

Values are made by the tests' own SM4 ECB code (test_fpc1_migration); TEST keys only.
"""

from __future__ import annotations

import base64
import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from pinrotate_core import rotation
from pinrotate_core.config import Settings
from tests.mariadb_server import MariaDbServer

from .test_fpc1_migration import K1, custom_settings, fpc1, write_keys

TENANT, OTHER = "acme", "globex"
FAILING_ID = 7
IDS = range(1, 11)

Execute = Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]


def unpads_under_k1(payload: bytes) -> bool:
    dec = Cipher(algorithms.SM4(K1), modes.ECB()).decryptor()
    unpadder = padding.PKCS7(128).unpadder()
    try:
        unpadder.update(dec.update(payload) + dec.finalize())
        unpadder.finalize()
    except ValueError:
        return False
    return True


def failing_k1_value() -> str:
    """A value labelled k1 that is not k1's: its padding fails under K1 (checked by the test's own SM4)."""
    rng = random.Random(7_2026)
    while True:
        payload = rng.randbytes(32)
        if not unpads_under_k1(payload):
            return f"FPC1:SM4:k1:{base64.b64encode(payload).decode()}"


@pytest.fixture(params=["postgresql", "mysql"])
def database(request: pytest.FixtureRequest) -> Iterator[tuple[str, Execute]]:
    """(URL, execute) of a fresh database on either engine."""
    if request.param == "postgresql":
        url = request.getfixturevalue("primary_database_url")
        with psycopg.connect(url, autocommit=True) as conn:
            def pg(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
                cur = conn.execute(statement, params)
                return list(cur.fetchall()) if cur.description else []

            yield url, pg
        return
    server: MariaDbServer = request.getfixturevalue("mariadb")
    name = request.getfixturevalue("mysql_database")
    with contextlib.closing(server.connect(name)) as my:
        def mysql(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
            with my.cursor() as cur:
                cur.execute(statement, params)
                return list(cur.fetchall())

        yield server.url(name), mysql


def build(database: tuple[str, Execute], tmp_path: Path) -> tuple[Settings, dict[int, str]]:
    """Ten k1 values, ``OTHER``'s row ``FAILING_ID`` not k1's; k2 current."""
    url, execute = database
    execute("CREATE TABLE creds (id bigint PRIMARY KEY, tenant varchar(16), pw varchar(200))", ())
    values = {i: fpc1("k1", K1, f"secret {i}".encode()) for i in IDS}
    values[FAILING_ID] = failing_k1_value()
    for i, v in values.items():
        execute("INSERT INTO creds VALUES (%s, %s, %s)", (i, OTHER if i == FAILING_ID else TENANT, v))
    keys = tmp_path / "keys.toml"
    write_keys(keys)
    return custom_settings(url, keys, {"table": "creds", "columns": ["pw"], "tenant": "tenant"}), values


def stored(execute: Execute) -> dict[int, str]:
    return {int(i): str(v) for i, v in execute("SELECT id, pw FROM creds", ())}


def test_a_shard_holds_back_a_key_whose_failing_value_is_in_another_shard(
        database: tuple[str, Execute], tmp_path: Path) -> None:
    settings, values = build(database, tmp_path)
    ctx = rotation.open_run(settings, expected_key="k2")
    try:
        rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        first = rotation.drain(ctx, "T", id_range=(None, 5))  # ids 1..5: every one of them k1's own
        second = rotation.drain(ctx, "T", id_range=(5, None))  # ids 6..10: the failing value is here
    finally:
        ctx.close()
    assert stored(database[1]) == values  # nothing under k1 was rewritten, in either shard
    assert (first.reencrypted, second.reencrypted) == (0, 0)
    assert first.counts["key_held"] == 5 and second.counts["key_held"] == 4
    assert [f.id for f in first.failed] == [] and [f.id for f in second.failed] == [str(FAILING_ID)]
    assert second.fail_closed  # the run's exit is 4: the shard holding the failing row says so


def test_a_tenant_run_holds_back_a_key_whose_failing_value_is_another_tenants(
        database: tuple[str, Execute], tmp_path: Path) -> None:
    settings, values = build(database, tmp_path)
    report = rotation.run_rotation(settings, expected_key="k2", tenant=TENANT)
    assert stored(database[1]) == values
    result = report.targets["T"]
    assert result.reencrypted == 0 and result.counts["key_held"] == len(IDS) - 1
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED
