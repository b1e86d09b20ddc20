"""Shard bounds follow the database's own order of the primary key, on a real PostgreSQL.

A shard is an id range ``(lo, hi]`` compared by the server; its bounds must therefore be in the
server's order of the key (its collation, its type's operators), never re-sorted by Python. A
text key under a natural (ICU) collation orders ``a < B < c`` where Python orders ``B < a < c``.
A ``citext`` key compares case-insensitively. Each test plans shards over such a key and checks,
with the server's own comparisons, that the shards cover every row exactly once, then drains
every shard and finds every row moved once. Keys are random TEST keys. tests/test_shard_keys_mysql.py
runs ``plan_and_drain`` on MariaDB under a case-insensitive collation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import rotation
from pinrotate_core.drain import Shard
from pinrotate_core.errors import ConfigError
from pinrotate_core.gate import retire_gate

from .test_fpc1_migration import K1, custom_settings, decrypt, fpc1, parse_fpc1, write_keys

ROWS = 240  # four shards of at least MIN_BATCHES_PER_SHARD batches of 2


def ids() -> list[str]:
    # Four blocks, lower and upper case alternating: a natural order puts them a < B < c < D, C (and
    # Python) order B < D < a < c; the shard bounds fall one in each block.
    return [f"{prefix}{i:03d}" for prefix in "aBcD" for i in range(ROWS // 4)]


def make_table(pg_conn: psycopg.Connection[Any], key_type: sql.Composable) -> None:
    pg_conn.execute(sql.SQL("CREATE TABLE creds (id {} PRIMARY KEY, pw text)").format(key_type))
    pg_conn.cursor().executemany("INSERT INTO creds VALUES (%s, %s)",
                                 [(i, fpc1("k1", K1, f"password {i}".encode())) for i in ids()])


Execute = Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]


def pg_execute(pg_conn: psycopg.Connection[Any]) -> Execute:
    def execute(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        cur = pg_conn.execute(statement, params)
        return list(cur.fetchall()) if cur.description else []

    return execute


def shard_members(execute: Execute, shards: list[Shard]) -> list[int]:
    """How many shards each row falls in, compared by the server (as the drain compares)."""
    conds = []
    params: list[Any] = []
    for s in shards:
        lo, hi = s.id_range
        parts = ["1 = 1"]
        if lo is not None:
            parts.append("id > %s")
            params.append(lo)
        if hi is not None:
            parts.append("id <= %s")
            params.append(hi)
        conds.append(f"(CASE WHEN {' AND '.join(parts)} THEN 1 ELSE 0 END)")
    return [int(r[0]) for r in execute(f"SELECT {' + '.join(conds)} FROM creds", tuple(params))]


def plan_and_drain(database_url: str, execute: Execute, keys_file: Path) -> None:
    write_keys(keys_file)
    settings = custom_settings(database_url, keys_file, {"table": "creds", "columns": ["pw"]})
    ctx = rotation.open_run(settings, target_names=["T"], expected_key="k2")
    try:
        rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        shards = rotation.plan_shards(ctx, "T", 4)
        assert len(shards) == 4
        members = shard_members(execute, shards)
        assert len(members) == ROWS and set(members) == {1}, "every row in exactly one shard"
        assert sum(s.rows for s in shards) == ROWS
        results = [rotation.drain(ctx, "T", workers=1, id_range=s.id_range, planned_backlog=s.rows) for s in shards]
    finally:
        ctx.close()
    assert all(r.stopped is None and r.conflicts == 0 and not r.failed for r in results), [r.error for r in results]
    assert sum(r.reencrypted for r in results) == ROWS
    assert [r.reencrypted for r in results] == [s.rows for s in shards]
    for row_id, pw in execute("SELECT id, pw FROM creds", ()):
        assert parse_fpc1(str(pw)).key_id == "k2" and decrypt(str(pw)) == f"password {row_id}".encode()


def test_a_text_key_under_a_natural_collation_gives_shards_that_cover_every_row_once(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    # ICU when the server has it, else a libc natural collation (en_US); both order a < B < c.
    row = pg_conn.execute("SELECT collname FROM pg_collation WHERE collname IN ('und-x-icu', 'en-x-icu') "
                          "OR collname ILIKE 'en_US.utf%%8' ORDER BY collprovider = 'i' DESC, collname DESC "
                          "LIMIT 1").fetchone()
    if row is None:
        pytest.skip("this server has no natural collation (und-x-icu, en-x-icu, en_US.utf8)")
    make_table(pg_conn, sql.SQL("text COLLATE {}").format(sql.Identifier(str(row[0]))))
    # The server's order really differs from Python's here.
    assert [r[0] for r in pg_conn.execute("SELECT id FROM creds ORDER BY id")] != sorted(ids())
    plan_and_drain(database_url, pg_execute(pg_conn), keys_file)


def test_a_citext_key_is_blocked_at_resolve_time_with_its_reason_and_nothing_is_written(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    if pg_conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'citext'").fetchone() is None:
        pytest.skip("the citext extension is not available on this server")
    pg_conn.execute("CREATE EXTENSION IF NOT EXISTS citext")
    make_table(pg_conn, sql.SQL("citext"))
    before = pg_conn.execute("SELECT id, pw FROM creds ORDER BY id").fetchall()
    write_keys(keys_file)
    settings = custom_settings(database_url, keys_file, {"table": "creds", "columns": ["pw"]})

    with pytest.raises(ConfigError) as refused:
        rotation.run_rotation(settings, expected_key="k2")
    message = str(refused.value)
    assert "\n" not in message
    assert "target T" in message and "id column id is citext" in message and "nothing was touched" in message
    assert pg_conn.execute("SELECT id, pw FROM creds ORDER BY id").fetchall() == before
    inv = rotation.inventory(settings).targets["T"]
    assert inv.counts["BLOCKED"] >= 1 and "id column id is citext" in (inv.blocked_reason or "")
    assert not retire_gate(settings, "k1").open
