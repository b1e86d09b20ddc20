"""The least privilege on PostgreSQL, as GRANT statements for a database owner to run (pinrotate
never runs them): a rotation role reads its target columns and writes only the cipher and
key-version columns; an auditor (inventory, gate) reads everything and writes nothing. Each
statement is a text without the closing ``;`` (the caller prints them)."""

from __future__ import annotations

from collections.abc import Sequence

from psycopg import sql


def _ident_list(names: Sequence[str]) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


def _relation(schema: str | None, table: str) -> sql.Identifier:
    return sql.Identifier(schema, table) if schema else sql.Identifier(table)


def auditor_grants(grantee: str) -> list[str]:
    """Read everything (the gate's sweep of every table) and see every session in flight:
    PostgreSQL's predefined ``pg_read_all_data`` and ``pg_read_all_stats`` (PostgreSQL 14+);
    nothing that writes."""
    return [sql.SQL("GRANT pg_read_all_data, pg_read_all_stats TO {}").format(sql.Identifier(grantee)).as_string()]


def schema_usage(schema: str, grantee: str) -> str:
    return sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), sql.Identifier(grantee)).as_string()


def rotation_grants(schema: str | None, table: str, read: Sequence[str], write: Sequence[str],
                    grantee: str) -> list[str]:
    """Column grants for one target: SELECT of every column read (system columns such as ``ctid``
    and ``xmin`` included), UPDATE of those written."""
    relation, role = _relation(schema, table), sql.Identifier(grantee)
    return [sql.SQL("GRANT SELECT ({}) ON {} TO {}").format(_ident_list(read), relation, role).as_string(),
            sql.SQL("GRANT UPDATE ({}) ON {} TO {}").format(_ident_list(write), relation, role).as_string()]


def bookkeeping_grants(schema: str, conflicts_table: str, key_checks_table: str, grantee: str) -> list[str]:
    """pinrotate's own tables in ``schema``: conflicts are replaced run by run; a key's check value
    is only ever added (never updated or deleted)."""
    role = sql.Identifier(grantee)
    return [schema_usage(schema, grantee),
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
                sql.Identifier(schema, conflicts_table), role).as_string(),
            sql.SQL("GRANT SELECT, INSERT ON {} TO {}").format(
                sql.Identifier(schema, key_checks_table), role).as_string()]
