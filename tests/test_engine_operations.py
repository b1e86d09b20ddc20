"""The SQL pieces each engine supplies (``engines/*/operations.py``): one statement composed from
them means the same on PostgreSQL and on MariaDB. Run on both real servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from pinrotate_core.engines.base.operations import Operations
from pinrotate_core.engines.mysql.operations import OPERATIONS as MYSQL
from pinrotate_core.engines.postgresql.operations import OPERATIONS as POSTGRES
from tests.mariadb_server import MariaDbServer

Query = Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]
ODD = 'Zoë 100% "quoted" `back` \'single\''


@pytest.fixture(params=["postgresql", "mysql"])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[Operations, Query]]:
    if request.param == "postgresql":
        conn = psycopg.connect(request.getfixturevalue("primary_database_url"), autocommit=True)

        def pg_query(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
            cur = conn.execute(statement, params)  # always a tuple: the pieces' '%' are doubled
            return list(cur.fetchall()) if cur.description else []

        try:
            yield POSTGRES, pg_query
        finally:
            conn.close()
        return
    server: MariaDbServer = request.getfixturevalue("mariadb")
    name = request.getfixturevalue("mysql_database")
    my = server.connect(name)

    def my_query(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with my.cursor() as cur:
            cur.execute(statement, params)  # always a tuple: the pieces' '%' are doubled
            return list(cur.fetchall())

    try:
        yield MYSQL, my_query
    finally:
        my.close()


def test_quoted_names_and_inlined_text_survive_any_character(engine: tuple[Operations, Query]) -> None:
    ops, query = engine
    table, column = 'we"ird`tab', ODD
    query(f"CREATE TABLE {ops.quote(table)} ({ops.quote('id')} INT PRIMARY KEY, {ops.quote(column)} TEXT)", ())
    query(f"INSERT INTO {ops.relation(None, table)} VALUES (1, {ops.text_literal(ODD)})", ())
    rows = query(f"SELECT {ops.column(column, 't')} FROM {ops.relation(None, table, 't')} WHERE "
                 f"{ops.column(column, 't')} = %s", (ODD,))
    assert rows == [(ODD,)]


def test_regex_matches_exactly_with_case(engine: tuple[Operations, Query]) -> None:
    ops, query = engine
    pattern = "^FPC1:[A-Za-z0-9]+:"
    cases = {"FPC1:k2025:abc": True, "fpc1:k2025:abc": False, "xFPC1:k:": False}
    for text, expected in cases.items():
        (row,) = query(f"SELECT CASE WHEN {ops.regex_match(ops.text_literal(text), '%s')} THEN 1 ELSE 0 END",
                       (pattern,))
        assert bool(row[0]) is expected, text


def test_binary_literals_and_null_safe_equality(engine: tuple[Operations, Query]) -> None:
    ops, query = engine
    blob = bytes(range(256))
    (row,) = query(f"SELECT {ops.binary_literal(blob)}, CASE WHEN {ops.null_safe_equal('NULL', 'NULL')} THEN 1 "
                   f"ELSE 0 END, CASE WHEN {ops.null_safe_equal(ops.text_literal('a'), 'NULL')} THEN 1 ELSE 0 END", ())
    assert bytes(row[0]) == blob and (row[1], row[2]) == (1, 0)


def test_keyset_batches_page_in_id_order_and_skip_rows_held_elsewhere(engine: tuple[Operations, Query]) -> None:
    ops, query = engine
    query(f"CREATE TABLE {ops.quote('t')} (id INT PRIMARY KEY, c TEXT)", ())
    for i in range(1, 8):
        query(f"INSERT INTO {ops.quote('t')} VALUES (%s, %s)", (i, f"v{i}"))
    conds, params = ops.keyset(ops.column("id", "t"), 2, 6)
    statement = ops.next_batch([ops.column("id", "t")], ops.relation(None, "t", "t"), ["TRUE", *conds],
                               ops.column("id", "t"))
    assert query(statement, (*params, 3)) == [(3,), (4,), (5,)]
    # The locking clause is valid where it is appended (no one else holds a row here).
    locked = ops.next_batch([ops.column("id", "t")], ops.relation(None, "t", "t"), conds, ops.column("id", "t"),
                            ops.lock_clause(skip_locked=True, of="t"))
    assert query(locked, (*params, 10)) == [(3,), (4,), (5,), (6,)]
