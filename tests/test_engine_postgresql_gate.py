"""The PostgreSQL room's gate checks (``engines/postgresql/gate.py``, ``base.checks.GateChecks``):
the engine-neutral answers over the pieces the PostgreSQL gate reads (in flight, prepared,
durability, positions, the sweep's candidate columns), on real servers."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator

import psycopg
import pytest
import sqlalchemy as sa

from pinrotate_core.engines.postgresql.connect import PgConnection
from pinrotate_core.engines.postgresql.room import ROOM
from pinrotate_core.errors import DatabaseError
from tests.helpers import url_as

LSN = re.compile(r"^[0-9A-F]+/[0-9A-F]+$")


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = ROOM.make_engine(database_url, pool_size=2)
    try:
        yield engine
    finally:
        engine.dispose()


def test_the_snapshot_sees_one_moment_refuses_writes_and_ends_rolled_back(
        engine: sa.Engine, database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as other:
        other.execute("CREATE TABLE moment (id int PRIMARY KEY)")
        other.execute("INSERT INTO moment VALUES (1)")
        with ROOM.raw_connection(engine) as conn:
            with ROOM.gate.snapshot(conn):
                assert conn.execute("SELECT count(*) FROM moment").fetchone() == (1,)
                other.execute("INSERT INTO moment VALUES (2)")  # committed after the snapshot's moment
                assert conn.execute("SELECT count(*) FROM moment").fetchone() == (1,)
                with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                    conn.execute("INSERT INTO moment VALUES (3)")
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert conn.execute("SELECT count(*) FROM moment").fetchone() == (2,)


def test_in_flight_names_a_session_in_a_transaction_and_leaves_idle_ones_and_its_own_out(
        engine: sa.Engine, database_url: str) -> None:
    with psycopg.connect(database_url) as app, psycopg.connect(database_url, autocommit=True) as idle:
        app.execute("SELECT 1")  # a transaction without an xid yet: it may still write
        idle.execute("SELECT 1")
        with ROOM.raw_connection(engine) as conn:
            found = ROOM.gate.in_flight(conn)
            assert [t.session for t in found] == [app.info.backend_pid]
            assert found[0].transaction.startswith(f"pid {app.info.backend_pid} since ")
            assert found[0].state == "idle in transaction" and found[0].open_s >= 0
            app.rollback()
            assert ROOM.gate.in_flight(conn) == []
            assert ROOM.gate.prepared(conn) == []


def test_in_flight_fails_closed_for_a_role_that_cannot_see_other_roles_sessions(
        database_url: str, pg_conn: PgConnection, make_role: Callable[[str], str]) -> None:
    role = make_role("gatecheck")
    engine = ROOM.make_engine(url_as(database_url, role), pool_size=1)
    try:
        # pg_conn (another role) is in this database
        with ROOM.raw_connection(engine) as conn, pytest.raises(
                DatabaseError, match=f"not visible to role {role}.*pg_read_all_stats"):
            ROOM.gate.in_flight(conn)
    finally:
        engine.dispose()


def test_durability_confirms_the_flush_at_the_primary_position(engine: sa.Engine) -> None:
    with ROOM.raw_connection(engine) as conn:
        position = ROOM.gate.primary_position(conn)
        assert position is not None and LSN.match(position)
        durability = ROOM.gate.durability(conn)
    assert durability.durable and durability.reasons == ()
    assert durability.settings["flushed"] is True and LSN.match(durability.settings["wal_flush_lsn"])


def test_a_physical_slot_is_a_replica_position_until_it_is_dropped(primary_database_url: str) -> None:
    slot = f"room_test_{secrets.token_hex(4)}"
    engine = ROOM.make_engine(primary_database_url, pool_size=1)
    try:
        with ROOM.raw_connection(engine) as conn:
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))
            try:
                mine = [p for p in ROOM.gate.replica_positions(conn) if p.name == f"physical slot {slot!r}"]
            finally:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            assert len(mine) == 1 and mine[0].running and mine[0].problem is None
            assert mine[0].position is not None and LSN.match(mine[0].position) and mine[0].lag_s is None
            assert not [p for p in ROOM.gate.replica_positions(conn) if slot in p.name]
    finally:
        engine.dispose()


def test_candidate_columns_are_the_columns_that_can_carry_a_ciphertext(engine: sa.Engine, database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as setup:
        setup.execute("CREATE TABLE carriers (id int PRIMARY KEY, name text, blob bytea, doc jsonb, tags text[],"
                      " born date, n numeric)")
        setup.execute("CREATE TEMPORARY TABLE mine (secret text)")  # this session's own: not another's
    with ROOM.raw_connection(engine) as conn:
        found = {c.label: c for c in ROOM.gate.candidate_columns(conn)}
    ours = {label: (c.type_name, c.binary, c.readable, c.transactional)
            for label, c in found.items() if label.startswith("public.carriers.")}
    assert ours == {"public.carriers.name": ("text", False, True, True),
                    "public.carriers.blob": ("bytea", True, True, True),
                    "public.carriers.doc": ("json", False, True, True),
                    "public.carriers.tags": ("container[]", False, True, True)}
    assert not [label for label in found if label.startswith(("pg_catalog.", "information_schema."))]
