"""The MySQL room's least privilege, applied on the real MariaDB: a rotation role with only its
column grants runs the whole compare-and-swap write; an auditor runs every gate check."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import pymysql
import pytest

from pinrotate_core.engines.mysql.catalog import CATALOG
from pinrotate_core.engines.mysql.connect import MySqlConnection, make_engine, raw_connection
from pinrotate_core.engines.mysql.gate import GATE_CHECKS
from pinrotate_core.engines.mysql.grants import account, auditor_grants, rotation_grants
from pinrotate_core.engines.mysql.guard import CasRow, MySqlCasGuard, batch_transaction
from tests.mariadb_server import MariaDbServer


def run(conn: MySqlConnection, statement: str, params: tuple[object, ...] | None = None) -> list[tuple[object, ...]]:
    with conn.cursor() as cur:
        cur.execute(statement, params)
        return list(cur.fetchall())


@contextlib.contextmanager
def connected_as(mariadb: MariaDbServer, database: str, grants: list[str], user: str) -> Iterator[MySqlConnection]:
    admin = mariadb.connect()
    engine = None
    try:
        run(admin, f"CREATE USER {account(user)} IDENTIFIED BY 'pw'", ())
        for grant in grants:
            run(admin, grant, ())  # composed of quoted names: with a parameter tuple
        engine = make_engine(f"mysql://{user}:pw@{mariadb.host}:{mariadb.port}/{database}")
        with raw_connection(engine) as conn:
            yield conn
    finally:
        if engine is not None:
            engine.dispose()
        with contextlib.suppress(pymysql.Error):
            run(admin, f"DROP USER {account(user)}", ())
        admin.close()


def test_a_rotation_role_with_column_grants_only_runs_the_whole_write(mariadb: MariaDbServer,
                                                                       mysql_database: str) -> None:
    with contextlib.closing(mariadb.connect(mysql_database)) as owner:
        run(owner, "CREATE TABLE persons (id BIGINT PRIMARY KEY, c VARCHAR(100), kv INT NOT NULL, secret TEXT,"
                   " update_time DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP)")
        run(owner, "INSERT INTO persons (id, c, kv, secret) VALUES (1, 'a', 1, 's'), (2, 'b', 1, 's')")
    user = f"pinrotate_t_{secrets.token_hex(4)}"
    grants = rotation_grants(mysql_database, "persons", ["id", "kv", "c"], ["c", "kv", "update_time"], account(user))
    with connected_as(mariadb, mysql_database, grants, user) as conn:
        table = CATALOG.read_table(conn, None, "persons", select=["id", "kv", "c"], update=["c", "kv"])
        assert table is not None and table.missing_privileges == ()
        assert "secret" not in table.columns  # a column it holds nothing on is not even shown
        guard = MySqlCasGuard(table, "id", ["c"], key_version="kv", stale_where="t.`kv` < 2")
        rows = guard.read_batch(conn, None, None, 10)
        with batch_transaction(conn, 1):
            outcome = guard.write(conn, [CasRow(r[0], (r[1],), (f"new-{r[0]}",)) for r in rows], key_version=2)
        assert outcome.written == [1, 2]
        with pytest.raises(pymysql.err.OperationalError, match="1143"):
            run(conn, "SELECT secret FROM persons")


def test_an_auditor_runs_every_gate_check_and_may_write_nothing(mariadb: MariaDbServer, mysql_database: str) -> None:
    with contextlib.closing(mariadb.connect(mysql_database)) as owner:
        run(owner, "CREATE TABLE t (id INT PRIMARY KEY, c TEXT)")
    user = f"pinrotate_t_{secrets.token_hex(4)}"
    with connected_as(mariadb, mysql_database, auditor_grants(account(user), "mariadb"), user) as conn:
        assert GATE_CHECKS.sees_every_table(conn)
        assert f"{mysql_database}.t.c" in {c.label for c in GATE_CHECKS.candidate_columns(conn) if c.readable}
        GATE_CHECKS.in_flight(conn)
        GATE_CHECKS.prepared(conn)
        GATE_CHECKS.durability(conn)
        GATE_CHECKS.primary_position(conn)
        assert GATE_CHECKS.replica_positions(conn) == []
        with pytest.raises(pymysql.err.OperationalError, match="1142"):
            run(conn, "INSERT INTO t VALUES (1, 'x')")


def test_keeping_on_update_columns_needs_update_on_them_and_its_lack_is_reported(
        mariadb: MariaDbServer, mysql_database: str) -> None:
    with contextlib.closing(mariadb.connect(mysql_database)) as owner:
        run(owner, "CREATE TABLE persons (id BIGINT PRIMARY KEY, c VARCHAR(100), kv INT NOT NULL,"
                   " update_time DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP)")
        run(owner, "INSERT INTO persons (id, c, kv) VALUES (1, 'a', 1)")
        table = CATALOG.read_table(owner, None, "persons")
    assert table is not None
    guard = MySqlCasGuard(table, "id", ["c"], key_version="kv", stale_where="t.`kv` < 2")
    select, update = guard.needed_privileges()
    assert (select, update) == (["id", "c", "kv", "update_time"], ["c", "kv", "update_time"])
    user = f"pinrotate_t_{secrets.token_hex(4)}"
    grants = rotation_grants(mysql_database, "persons", ["id", "kv", "c", "update_time"], ["c", "kv"], account(user))
    with connected_as(mariadb, mysql_database, grants, user) as conn:
        seen = CATALOG.read_table(conn, None, "persons", select=select, update=update)
        assert seen is not None and seen.missing_privileges == (("UPDATE", "update_time"),)
        rows = guard.read_batch(conn, None, None, 10)
        # The server refuses the write rather than let update_time move: nothing is written.
        with pytest.raises(pymysql.err.OperationalError, match="1143"), batch_transaction(conn, 1):
            guard.write(conn, [CasRow(r[0], (r[1],), ("new",)) for r in rows], key_version=2)
        assert run(conn, "SELECT c, kv FROM persons") == [("a", 1)]
