"""Targets: a configured table resolved against the live database before anything is written.

Resolution checks what the migrator must not fix itself (contract §6 BLOCKED): missing table or
column, no single primary key, a read-only connection, missing privileges, an unusable column
type. It never runs DDL.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from .config import TargetSettings
from .errors import DatabaseError, TargetBlocked

CIPHER_TYPES = {"bytea", "text", "varchar", "bpchar"}
INTEGER_TYPES = {"int2", "int4", "int8", "numeric"}
FPC1_TYPES = {"text", "varchar", "json", "jsonb"}


@dataclass(frozen=True)
class Column:
    name: str
    sql_type: str  # format_type(): e.g. "character varying(255)", "bytea"
    type_name: str  # pg_type.typname: "varchar", "bytea", ...
    char_length: int | None  # declared length of varchar(n) / char(n)


@dataclass(frozen=True)
class ResolvedTarget:
    """A target whose table and columns exist as configured; identifiers ready to compose."""

    settings: TargetSettings
    relation: sql.Identifier
    id_column: Column
    key_version: Column | None
    columns: tuple[Column, ...]

    @property
    def name(self) -> str:
        return self.settings.name

    def ident(self, column: str) -> sql.Identifier:
        return sql.Identifier(column)


def relation_of(t: TargetSettings) -> sql.Identifier:
    return sql.Identifier(t.schema_name, t.table_name) if t.schema_name else sql.Identifier(t.table_name)


def resolve_target(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings) -> ResolvedTarget:
    """Check ``t`` against the catalog; raise TargetBlocked naming what is wrong."""
    relation = relation_of(t)
    regname = relation.as_string(conn)
    try:
        row = conn.execute(
            "SELECT to_regclass(%s)::oid, pg_is_in_recovery(), current_setting('transaction_read_only')",
            (regname,),
        ).fetchone()
        assert row is not None
        oid, in_recovery, read_only = row
        if oid is None:
            raise TargetBlocked(t.name, f"table {t.table} does not exist")
        if in_recovery or read_only == "on":
            raise TargetBlocked(t.name, "the database connection is read-only")
        cols = {
            str(name): Column(str(name), str(sql_type), str(type_name), char_len if isinstance(char_len, int) else None)
            for name, sql_type, type_name, char_len in conn.execute(
                """
                SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typname,
                       CASE WHEN t.typname IN ('varchar', 'bpchar') AND a.atttypmod > 4
                            THEN a.atttypmod - 4 END
                  FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
                 WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
                """,
                (oid,),
            ).fetchall()
        }
        pk_row = conn.execute(
            """
            SELECT array_agg(a.attname::text ORDER BY a.attnum)
              FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
             WHERE i.indrelid = %s AND i.indisprimary
            """,
            (oid,),
        ).fetchone()
        priv = conn.execute(
            "SELECT has_table_privilege(%s, 'SELECT'), has_table_privilege(%s, 'UPDATE')", (oid, oid)
        ).fetchone()
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the catalog ({type(e).__name__})") from None

    pk = [str(c) for c in pk_row[0]] if pk_row and isinstance(pk_row[0], list) else []
    if len(pk) != 1:
        raise TargetBlocked(t.name, f"table {t.table} has no single-column primary key")
    if pk[0] != t.id:
        raise TargetBlocked(t.name, f"id column {t.id} is not the primary key of {t.table} (it is {pk[0]})")
    assert priv is not None
    if not priv[0] or not priv[1]:
        raise TargetBlocked(t.name, f"no SELECT and UPDATE privilege on {t.table}")

    def need(column: str, role: str) -> Column:
        if column not in cols:
            raise TargetBlocked(t.name, f"{role} column {column} does not exist in {t.table}")
        return cols[column]

    id_column = need(t.id, "id")
    key_version = None
    if t.key_version:
        key_version = need(t.key_version, "key_version")
        if key_version.type_name not in INTEGER_TYPES:
            raise TargetBlocked(t.name, f"key_version column {t.key_version} is {key_version.sql_type}, not an integer")
    cipher_cols = tuple(need(c, "cipher") for c in t.columns)
    for c in cipher_cols:
        if c.type_name not in CIPHER_TYPES and c.type_name not in ("json", "jsonb"):
            raise TargetBlocked(t.name, f"cipher column {c.name} is {c.sql_type}; expected bytea, text or varchar")
    for name in t.require_not_null:
        need(name, "require_not_null")
    if t.tenant:
        need(t.tenant, "tenant")
    if t.soft_delete:
        need(t.soft_delete, "soft_delete")
    if t.format == "aesgcm" and any(c.type_name in ("json", "jsonb") for c in cipher_cols):
        raise TargetBlocked(t.name, "aesgcm cipher columns must be bytea or text")
    if t.format == "fpc1":
        # FPC1 is text: bytea cannot hold it as written, char(n) would pad it with blanks.
        for c in cipher_cols:
            if c.type_name not in FPC1_TYPES:
                raise TargetBlocked(t.name, f"cipher column {c.name} is {c.sql_type}; fpc1 needs text, varchar(n), "
                                            "json or jsonb")
            if c.type_name in ("json", "jsonb") and not t.json_paths.get(c.name):
                raise TargetBlocked(t.name, f"cipher column {c.name} is {c.sql_type}: name its encrypted fields "
                                            "in json_paths")
    # The room a value needs after rewriting depends on the data and the current key:
    # inventory.capacity_blocker checks it (rotation.resolve_all, inventory).
    return ResolvedTarget(t, relation, id_column, key_version, cipher_cols)
