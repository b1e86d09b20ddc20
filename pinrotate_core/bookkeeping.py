"""The ``pinrotate`` schema: where pinrotate keeps what the target tables cannot show (conflicts,
key check values). Its tables are created on first use, each once across hosts, or ahead by an
administrator; pinrotate never creates anything outside this schema.
"""

from __future__ import annotations

from typing import Any, Final

import psycopg
from psycopg import sql

SCHEMA: Final = "pinrotate"


def table_exists(conn: psycopg.Connection[Any], table: str) -> bool:
    """Is there a ``pinrotate.<table>``? From the catalog, which every role may read (``to_regclass``
    fails on a schema the role may not use)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p'))", (SCHEMA, table)).fetchone()
    return bool(row and row[0])


def create_once(conn: psycopg.Connection[Any], table: str, create: sql.Composed, lock_key: str) -> None:
    """Run ``create`` unless ``pinrotate.<table>`` exists, in its own transaction (``conn`` is in
    autocommit mode), serialised across processes and hosts by an advisory lock on ``lock_key``.
    Errors (InsufficientPrivilege above all) are the caller's to word."""
    if table_exists(conn, table):
        return  # CREATE SCHEMA IF NOT EXISTS would still ask for CREATE on the database
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (lock_key,))
        if not table_exists(conn, table):
            conn.execute(create)
