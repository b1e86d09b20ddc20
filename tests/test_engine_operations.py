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
from pinrotate_core.schemes.transit import transit_version_or_none, transit_version_sql
from pinrotate_core.targets import Column
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
        (row,) = query(f"SELECT CASE WHEN {ops.regex_match(ops.text_literal(text), pattern)} THEN 1 ELSE 0 END", ())
        assert bool(row[0]) is expected, text


def test_a_final_dollar_is_the_end_of_the_text_never_before_a_newline(engine: tuple[Operations, Query]) -> None:
    """PCRE and ICU read '$' as "at the end or before a final newline"; PostgreSQL's ~ as the end.
    The piece means the end on every engine (a soft-delete value '0\\n' is not the number zero)."""
    ops, query = engine
    cases = {"0": True, "0\n": False, "0\n\n": False, "0 ": False, "a$": True, "a$\n": False}
    for text, expected in cases.items():
        pattern = "^[0]$" if text.startswith("0") else "^a\\$$"
        (row,) = query(f"SELECT CASE WHEN {ops.regex_match(ops.text_literal(text), pattern)} THEN 1 ELSE 0 END", ())
        assert bool(row[0]) is expected, repr(text)


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


def test_starts_with_compares_bytes_not_characters_under_a_collation(engine: tuple[Operations, Query]) -> None:
    """The fpc1 pre-filter's piece: MariaDB's default collation folds case and ignores trailing
    blanks; a prefix must match byte for byte, as PostgreSQL's starts_with does."""
    ops, query = engine
    query(f"CREATE TABLE {ops.quote('p')} (id INT PRIMARY KEY, c VARCHAR(64))", ())
    cases = {1: ("FPC1:SM4:k2:abc", True), 2: ("fpc1:sm4:K2:abc", False), 3: ("FPC1:SM4:k2", False),
             4: ("FPC1:SM4:k2:", True), 5: (" FPC1:SM4:k2:", False), 6: ("FPC1:SM4:k20:x", False)}
    for i, (text, _) in cases.items():
        query(f"INSERT INTO {ops.quote('p')} VALUES (%s, %s)", (i, text))
    got = query(f"SELECT id, CASE WHEN {ops.starts_with(ops.text_of(ops.column('c')), 'FPC1:SM4:k2:')} THEN 1 ELSE 0"
                f" END FROM {ops.quote('p')} ORDER BY id", ())
    assert {int(i): bool(v) for i, v in got} == {i: expected for i, (_, expected) in cases.items()}


def test_before_first_and_to_int_read_a_number_out_of_text(engine: tuple[Operations, Query]) -> None:
    ops, query = engine
    (row,) = query(f"SELECT {ops.to_int(ops.before_first(ops.text_literal('12:rest:more'), ':'))},"
                   f" {ops.before_first(ops.text_literal('no separator'), ':')}", ())
    assert (int(row[0]), row[1]) == (12, "no separator")


TRANSIT_CASES = ["vault:v1:AAAA", "vault:v12:QUJD", "vault:v9999999999:AAAA", "vault:v0:AAAA", "vault:v01:AAAA",
                 "VAULT:v1:AAAA", "vault:v1:AAA", "vault:v1:AA==", "vault:v1:AAAA\n", "xvault:v1:AAAA",
                 "vault:v1:AAAA:AAAA", "vault:v1:", "vault:v1:Zm9v!", "vault:v3:Zm9vYg==", "", "vault:vX:AAAA"]


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_transit_version_in_sql_is_what_python_reads(engine: tuple[Operations, Query], binary: bool) -> None:
    """The one SQL form of a Transit value's version (``transit_version_sql``), composed of either
    engine's pieces, names the same version as ``transit_version_or_none`` for every value,
    including the ones it must refuse (a trailing newline, a leading zero, bad base64), in a text
    and a binary column."""
    ops, query = engine
    type_name = ("bytea" if ops is POSTGRES else "varbinary") if binary else ("text" if ops is POSTGRES else "varchar")
    sql_type = type_name if not binary or ops is POSTGRES else "VARBINARY(64)"
    sql_type = "VARCHAR(64)" if sql_type == "varchar" else sql_type
    query(f"CREATE TABLE {ops.quote('v')} (id INT PRIMARY KEY, c {sql_type})", ())
    values: list[Any] = [*TRANSIT_CASES, None]
    if binary:
        values += [b"vault:v2:\xff\xfeAA", "vault:v2:\u00e9AAA"]
    for i, value in enumerate(values):
        query(f"INSERT INTO {ops.quote('v')} VALUES (%s, %s)", (i, value.encode() if binary and isinstance(value, str)
                                                                else value))
    column = Column("c", sql_type, type_name, None)
    got = dict(query(f"SELECT id, {transit_version_sql(ops, column, 't')} FROM {ops.relation(None, 'v', 't')}", ()))
    expected = {i: transit_version_or_none(v) for i, v in enumerate(values)}
    assert {int(i): (None if v is None else int(v)) for i, v in got.items()} == expected
