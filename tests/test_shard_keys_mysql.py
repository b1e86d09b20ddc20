"""Shard bounds follow the server's own order of the primary key, on MariaDB (issue 32): the text-key
test of tests/test_shard_keys.py (its ``plan_and_drain``: the same assertions) over a key under
MariaDB's default case-insensitive collation (``utf8mb4_general_ci``), which orders ``a < B < c < D`` where Python orders
``B < D < a < c``. Not twinned: ``citext`` (PostgreSQL's; on MariaDB a case-insensitive key is the
default collation, tested here). No gate is asked: the shared server will do. TEST keys only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mariadb_server import MariaDbServer

from .test_fpc1_migration import K1, fpc1
from .test_shard_keys import Execute, ids, plan_and_drain

pytestmark = pytest.mark.mysql


@pytest.fixture
def execute(mariadb: MariaDbServer, mysql_database: str) -> Iterator[Execute]:
    with contextlib.closing(mariadb.connect(mysql_database)) as conn:
        def run(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
            with conn.cursor() as cur:
                cur.execute(statement, params or None)
                return list(cur.fetchall())

        yield run


def test_a_text_key_under_a_case_insensitive_collation_gives_shards_that_cover_every_row_once_on_mariadb(
        execute: Execute, mariadb: MariaDbServer, mysql_database: str, keys_file: Path) -> None:
    execute("CREATE TABLE creds (id varchar(8) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci PRIMARY KEY,"
            " pw varchar(200)) ENGINE=InnoDB", ())
    rows = [(i, fpc1("k1", K1, f"password {i}".encode())) for i in ids()]
    execute("INSERT INTO creds VALUES " + ", ".join(["(%s, %s)"] * len(rows)), tuple(x for r in rows for x in r))
    # The server's order really differs from Python's here.
    assert [r[0] for r in execute("SELECT id FROM creds ORDER BY id", ())] != sorted(ids())
    plan_and_drain(mariadb.url(mysql_database), execute, keys_file)
