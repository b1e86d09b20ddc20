"""The PostgreSQL room's GRANT statements (``engines/postgresql/grants.py``), run by an owner on a
real server: the role then holds exactly the column privileges named. Which columns a
configuration needs is tested in tests/test_privileges.py (``python -m flows.rotate grants``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from pinrotate_core.engines.postgresql import grants


def privileges(conn: psycopg.Connection[Any], role: str, relation: str,
               columns: list[str]) -> dict[str, tuple[bool, bool]]:
    """(may SELECT, may UPDATE) of each column, as the server decides for ``role``."""
    out: dict[str, tuple[bool, bool]] = {}
    for c in columns:
        row = conn.execute("SELECT has_column_privilege(%s, %s::regclass, %s, 'SELECT'), "
                           "has_column_privilege(%s, %s::regclass, %s, 'UPDATE')", (role, relation, c) * 2).fetchone()
        assert row is not None
        out[c] = (bool(row[0]), bool(row[1]))
    return out


def test_rotation_and_bookkeeping_grants_name_only_their_columns_and_tables(
        pg_conn: psycopg.Connection[Any], make_role: Callable[[str], str]) -> None:
    role = make_role("rot")
    pg_conn.execute('CREATE SCHEMA "app%s"')
    pg_conn.execute('CREATE TABLE "app%s".people (id int PRIMARY KEY, kv int, name_cipher text, note text)')
    pg_conn.execute("CREATE SCHEMA books")
    pg_conn.execute("CREATE TABLE books.c (x int)")
    pg_conn.execute("CREATE TABLE books.k (x int)")
    statements = [grants.schema_usage("app%s", role),
                  *grants.rotation_grants("app%s", "people", ["id", "kv", "name_cipher", "ctid", "xmin"],
                                          ["name_cipher", "kv"], role),
                  *grants.bookkeeping_grants("books", "c", "k", role)]
    assert statements[1] == (f'GRANT SELECT ("id", "kv", "name_cipher", "ctid", "xmin") ON "app%s"."people" '
                             f'TO "{role}"')
    for s in statements:
        pg_conn.execute(s.encode())  # bytes: run as written, no placeholders read
    assert privileges(pg_conn, role, '"app%s".people', ["id", "kv", "name_cipher", "note", "ctid"]) == {
        "id": (True, False), "kv": (True, True), "name_cipher": (True, True), "note": (False, False),
        "ctid": (True, False)}
    row = pg_conn.execute("SELECT has_table_privilege(%s, 'books.c', 'DELETE'), "
                          "has_table_privilege(%s, 'books.k', 'INSERT'), has_table_privilege(%s, 'books.k', 'UPDATE'),"
                          " has_schema_privilege(%s, 'books', 'USAGE')", (role,) * 4).fetchone()
    assert row == (True, True, False, True)


def test_the_auditor_reads_everything_and_writes_nothing(
        pg_conn: psycopg.Connection[Any], make_role: Callable[[str], str]) -> None:
    role = make_role("audit")
    pg_conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    [statement] = grants.auditor_grants(role)
    pg_conn.execute(statement.encode())
    row = pg_conn.execute("SELECT has_table_privilege(%s, 't', 'SELECT'), has_table_privilege(%s, 't', 'UPDATE'), "
                          "pg_has_role(%s, 'pg_read_all_stats', 'USAGE')", (role,) * 3).fetchone()
    assert row == (True, False, True)
