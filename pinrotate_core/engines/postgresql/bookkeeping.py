"""pinrotate's own bookkeeping on PostgreSQL: the ``pinrotate`` schema with the tables
``conflicts`` and ``key_checks`` (MySQL's is ``mysql/bookkeeping.py``, the ``pinrotate``
database). The DDL, whether a table exists, its creation once across hosts, the writers'
transaction (flushed to disk at commit, serialised by an advisory lock), the CONFLICT upserts,
deletes and sum, the key checks' insert and read. Statements and their results only: what is
recorded, and which errors close or refuse what, is the caller's (``conflicts.py``,
``key_checks.py``); the driver's errors are raised as they come.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg import sql

SCHEMA: Final = "pinrotate"
CONFLICTS: Final = "conflicts"
KEY_CHECKS: Final = "key_checks"
_CONFLICTS = sql.Identifier(SCHEMA, CONFLICTS)
_KEY_CHECKS = sql.Identifier(SCHEMA, KEY_CHECKS)

# The whole DDL pinrotate ever runs (docs/reference.md, "The pinrotate.conflicts table" and
# "The pinrotate.key_checks table").
CREATE_TABLES: Final[Mapping[str, sql.Composed]] = {
    CONFLICTS: sql.SQL(
        "CREATE SCHEMA IF NOT EXISTS {schema}; "
        "CREATE TABLE IF NOT EXISTS {table} ("
        " target text NOT NULL,"
        " tenant text NOT NULL,"
        " conflicts integer NOT NULL CHECK (conflicts > 0),"
        " run_id text NOT NULL,"
        " recorded_at timestamptz NOT NULL DEFAULT now(),"
        " PRIMARY KEY (target, tenant))"
    ).format(schema=sql.Identifier(SCHEMA), table=_CONFLICTS),
    KEY_CHECKS: sql.SQL(
        "CREATE SCHEMA IF NOT EXISTS {schema}; "
        "CREATE TABLE IF NOT EXISTS {table} ("
        " keyring text NOT NULL,"
        " key_id text NOT NULL,"
        " check_value text NOT NULL,"
        " algorithm text NOT NULL,"
        " recorded_at timestamptz NOT NULL DEFAULT now(),"
        " recorded_by text NOT NULL,"
        " PRIMARY KEY (keyring, key_id))"
    ).format(schema=sql.Identifier(SCHEMA), table=_KEY_CHECKS),
}

# A CONFLICT count per (target, tenant): keep the larger of the stored and the new count...
_UPSERT_LARGER: Final = sql.SQL(
    "INSERT INTO {t} (target, tenant, conflicts, run_id) VALUES (%s, %s, %s, %s) "
    "ON CONFLICT (target, tenant) DO UPDATE SET conflicts = GREATEST({t}.conflicts, "
    "EXCLUDED.conflicts), run_id = EXCLUDED.run_id, recorded_at = now()").format(t=_CONFLICTS)
# ... or, from a shard of the run that stored the row, add to it.
_UPSERT_ADDING: Final = sql.SQL(
    "INSERT INTO {t} (target, tenant, conflicts, run_id) VALUES (%s, %s, %s, %s) "
    "ON CONFLICT (target, tenant) DO UPDATE SET conflicts = CASE WHEN {t}.run_id = "
    "EXCLUDED.run_id THEN {t}.conflicts + EXCLUDED.conflicts ELSE GREATEST({t}.conflicts, "
    "EXCLUDED.conflicts) END, run_id = EXCLUDED.run_id, recorded_at = now()").format(t=_CONFLICTS)


def table_exists(conn: psycopg.Connection[Any], table: str) -> bool:
    """Is there a ``pinrotate.<table>``? From the catalog, which every role may read (``to_regclass``
    fails on a schema the role may not use)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p'))", (SCHEMA, table)).fetchone()
    return bool(row and row[0])


@contextmanager
def transaction(conn: psycopg.Connection[Any], *, durable: bool = False, lock: str | None = None) -> Iterator[None]:
    """One transaction (a savepoint when one is open). ``durable``: committed with
    ``synchronous_commit = on``, so flushed to disk before it returns; ``lock``: serialised with
    pinrotate's other writers across processes and hosts by an advisory lock on that key."""
    with conn.transaction():
        if durable:
            conn.execute("SET LOCAL synchronous_commit = on")
        if lock is not None:
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (lock,))
        yield


def create_once(conn: psycopg.Connection[Any], table: str, lock_key: str) -> None:
    """Create ``pinrotate.<table>`` (``CREATE_TABLES``) unless it exists, in its own transaction
    (``conn`` is in autocommit mode), serialised across processes and hosts by an advisory lock on
    ``lock_key``. Errors (InsufficientPrivilege above all) are the caller's to word."""
    if table_exists(conn, table):
        return  # CREATE SCHEMA IF NOT EXISTS would still ask for CREATE on the database
    with transaction(conn, lock=lock_key):
        if not table_exists(conn, table):
            conn.execute(CREATE_TABLES[table])


def current_role(conn: psycopg.Connection[Any]) -> str:
    """The role whose privileges PostgreSQL checks (``current_user``: after a SET ROLE, or a login
    role that differs from the URL's user, that is the one to grant to)."""
    try:
        with conn.transaction():  # a savepoint when the failed statement's transaction is still open
            row = conn.execute("SELECT current_user::text").fetchone()
    except psycopg.Error:
        return conn.info.user or "?"
    return str(row[0]) if row else (conn.info.user or "?")


# --- conflicts ------------------------------------------------------------------------------------


def delete_conflicts(conn: psycopg.Connection[Any], target: str, tenant: str | None) -> None:
    """Forget ``target``'s counts: every tenant's (``tenant`` None) or one tenant's."""
    if tenant is None:
        conn.execute(sql.SQL("DELETE FROM {} WHERE target = %s").format(_CONFLICTS), (target,))
    else:
        conn.execute(sql.SQL("DELETE FROM {} WHERE target = %s AND tenant = %s").format(_CONFLICTS),
                     (target, tenant))


def upsert_conflicts(conn: psycopg.Connection[Any], target: str, counts: Mapping[str, int], run_id: str, *,
                     add_within_run: bool) -> None:
    """Per tenant (in order): insert ``counts[tenant]``, or keep the larger of it and the stored
    count; ``add_within_run``: a shard of the run that stored the row adds its count instead."""
    statement = _UPSERT_ADDING if add_within_run else _UPSERT_LARGER
    for tenant, n in sorted(counts.items()):
        conn.execute(statement, (target, tenant, n, run_id))


def sum_conflicts(conn: psycopg.Connection[Any], target: str, tenant: str | None) -> int:
    """``target``'s recorded CONFLICTs: one tenant's, or every tenant's (a savepoint when the
    caller has a transaction open)."""
    query = sql.SQL("SELECT coalesce(sum(conflicts), 0) FROM {} WHERE target = %s").format(_CONFLICTS)
    params: list[Any] = [target]
    if tenant is not None:
        query += sql.SQL(" AND tenant = %s")
        params.append(tenant)
    with conn.transaction():
        row = conn.execute(query, params).fetchone()
    return int(row[0]) if row else 0


# --- key checks -----------------------------------------------------------------------------------


def insert_key_checks(conn: psycopg.Connection[Any], keyring: str, by: str,
                      checks: Sequence[tuple[str, str, str]]) -> set[str]:
    """``(key_id, check_value, algorithm)`` each, inserted where nothing is recorded for the key id
    (``ON CONFLICT DO NOTHING``: a recorded value is never replaced; of two first runs at once, the
    second waits for the first one's row): the key ids inserted."""
    return {str(r[0]) for r in conn.execute(sql.SQL(
        "INSERT INTO {} (keyring, key_id, check_value, algorithm, recorded_by) "
        "SELECT %s, k, v, a, %s FROM unnest(%s::text[], %s::text[], %s::text[]) AS u(k, v, a) "
        "ON CONFLICT DO NOTHING RETURNING key_id").format(_KEY_CHECKS),
        (keyring, by, [c[0] for c in checks], [c[1] for c in checks], [c[2] for c in checks])).fetchall()}


def read_key_checks(conn: psycopg.Connection[Any], keyring: str,
                    key_ids: Sequence[str]) -> dict[str, tuple[str, str, datetime, str]]:
    """key id -> (check_value, algorithm, recorded_at, recorded_by) for those recorded."""
    rows = conn.execute(sql.SQL(
        "SELECT key_id, check_value, algorithm, recorded_at, recorded_by FROM {} "
        "WHERE keyring = %s AND key_id = ANY(%s)").format(_KEY_CHECKS),
        (keyring, list(key_ids))).fetchall()
    return {str(r[0]): (r[1], r[2], r[3], r[4]) for r in rows}
