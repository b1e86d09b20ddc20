"""Facts of the last runs that the target tables cannot show: the CONFLICT counts of ``fpc1`` targets.

They live in the database itself, in pinrotate's one bookkeeping table ``pinrotate.conflicts``
(target, tenant, count, run id, time), so that a gate on any host sees what a run on another host
left. pinrotate creates that schema and table on first use and never touches any other schema.
It holds counts, target names and tenants only: never a value, key or URL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from .bookkeeping import SCHEMA, create_once, table_exists
from .db import describe_db_error
from .errors import PinrotateError

NO_TENANT: Final = ""  # the tenant key of targets without a tenant column (and of rows whose tenant is NULL)
TABLE: Final = "conflicts"
QUALIFIED: Final = f"{SCHEMA}.{TABLE}"
_TABLE = sql.Identifier(SCHEMA, TABLE)
# Serialises pinrotate's writers of the table (creation included) across processes and hosts.
_LOCK_KEY: Final = "pinrotate.conflicts"

# The whole DDL pinrotate ever runs (docs/reference.md, "The pinrotate.conflicts table").
CREATE_SQL: Final = sql.SQL(
    "CREATE SCHEMA IF NOT EXISTS {schema}; "
    "CREATE TABLE IF NOT EXISTS {table} ("
    " target text NOT NULL,"
    " tenant text NOT NULL,"
    " conflicts integer NOT NULL CHECK (conflicts > 0),"
    " run_id text NOT NULL,"
    " recorded_at timestamptz NOT NULL DEFAULT now(),"
    " PRIMARY KEY (target, tenant))"
).format(schema=sql.Identifier(SCHEMA), table=_TABLE)


class StateError(PinrotateError):
    """The CONFLICT records cannot be read or written."""


def _role(conn: psycopg.Connection[Any]) -> str:
    """The role whose privileges PostgreSQL checks (``current_user``: after a SET ROLE, or a login
    role that differs from the URL's user, that is the one to grant to)."""
    try:
        with conn.transaction():  # a savepoint when the failed statement's transaction is still open
            row = conn.execute("SELECT current_user::text").fetchone()
    except psycopg.Error:
        return conn.info.user or "?"
    return str(row[0]) if row else (conn.info.user or "?")


def conflicts_table_exists(conn: psycopg.Connection[Any]) -> bool:
    """Is there a ``pinrotate.conflicts`` table?"""
    return table_exists(conn, TABLE)


def ensure_conflicts_table(conn: psycopg.Connection[Any]) -> None:
    """Create ``pinrotate.conflicts`` unless it exists (in its own transaction; ``conn`` is in
    autocommit mode). StateError with the privilege to grant when the role may not."""
    try:
        create_once(conn, TABLE, CREATE_SQL, _LOCK_KEY)
    except pg_errors.InsufficientPrivilege:
        raise StateError(
            f"role {_role(conn)} may not create {QUALIFIED}, where pinrotate records CONFLICTs for the gate: "
            f"GRANT CREATE ON DATABASE {conn.info.dbname} TO {_role(conn)}, or create it ahead "
            "(docs/reference.md, \"The pinrotate.conflicts table\")") from None
    except psycopg.Error as e:
        raise StateError(f"cannot create {QUALIFIED} ({describe_db_error(e)})") from None


def record_conflicts(conn: psycopg.Connection[Any], target: str, by_tenant: Mapping[str, int], *,
                     tenant_scope: str | None, complete: bool, run_id: str = "", shard: bool = False) -> None:
    """Store the CONFLICT counts of one non-dry run of ``target`` (one transaction, flushed to disk
    before it returns: a gate must never miss a conflict a crash could lose).

    A complete run replaces what it covered: all tenants (``tenant_scope`` None) or its one tenant,
    so a later clean run clears earlier conflicts. A run that stopped early saw only part of the
    target: it clears nothing, and a tenant's count becomes the larger of the stored one and its own
    (the conflicts it did not revisit may still stand).

    One ``shard`` of a run (an id range) saw only its range, complete or not: it clears nothing and
    adds its counts to what other shards of the same run (``run_id``) recorded (the larger, against
    an earlier run's count), so sibling shards never erase each other's conflicts. Once every shard
    of the target has ended, the run records its total once more, unsharded, which replaces (or,
    if a shard stopped early, keeps the larger of) what the shards left.
    """
    found = {t: n for t, n in by_tenant.items() if n > 0}
    try:
        if not found and not conflicts_table_exists(conn):
            return  # nothing to add, and nothing was ever recorded to clear
        ensure_conflicts_table(conn)
        with conn.transaction():
            conn.execute("SET LOCAL synchronous_commit = on")
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (_LOCK_KEY,))
            if shard:
                found = {t: n for t, n in found.items() if tenant_scope is None or t == tenant_scope}
                for tenant, n in sorted(found.items()):
                    conn.execute(sql.SQL(
                        "INSERT INTO {t} (target, tenant, conflicts, run_id) VALUES (%s, %s, %s, %s) "
                        "ON CONFLICT (target, tenant) DO UPDATE SET conflicts = CASE WHEN {t}.run_id = "
                        "EXCLUDED.run_id THEN {t}.conflicts + EXCLUDED.conflicts ELSE GREATEST({t}.conflicts, "
                        "EXCLUDED.conflicts) END, run_id = EXCLUDED.run_id, recorded_at = now()").format(t=_TABLE),
                        (target, tenant, n, run_id))
                return
            if complete and tenant_scope is None:
                conn.execute(sql.SQL("DELETE FROM {} WHERE target = %s").format(_TABLE), (target,))
            elif complete:
                conn.execute(sql.SQL("DELETE FROM {} WHERE target = %s AND tenant = %s").format(_TABLE),
                             (target, tenant_scope))
                found = {t: n for t, n in found.items() if t == tenant_scope}
            for tenant, n in sorted(found.items()):
                conn.execute(sql.SQL(
                    "INSERT INTO {t} (target, tenant, conflicts, run_id) VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT (target, tenant) DO UPDATE SET conflicts = GREATEST({t}.conflicts, "
                    "EXCLUDED.conflicts), run_id = EXCLUDED.run_id, recorded_at = now()").format(t=_TABLE),
                    (target, tenant, n, run_id))
    except StateError:
        raise
    except pg_errors.InsufficientPrivilege:
        raise StateError(f"role {_role(conn)} may not write {QUALIFIED}: GRANT SELECT, INSERT, UPDATE, DELETE "
                         f"ON {QUALIFIED} TO {_role(conn)} (and USAGE ON SCHEMA {SCHEMA})") from None
    except psycopg.Error as e:
        raise StateError(f"cannot record the CONFLICTs of target {target} in {QUALIFIED} "
                         f"({describe_db_error(e)})") from None


def last_conflicts(conn: psycopg.Connection[Any], target: str, *, tenant: str | None = None) -> int:
    """CONFLICT count of ``target`` left by the last runs: one tenant's, or every tenant's.

    No table: no run ever had a conflict to record (a run creates it before its first write). A
    table this role may not read is a StateError: conflicts we cannot see might exist.
    """
    query = sql.SQL("SELECT coalesce(sum(conflicts), 0) FROM {} WHERE target = %s").format(_TABLE)
    params: list[Any] = [target]
    if tenant is not None:
        query += sql.SQL(" AND tenant = %s")
        params.append(tenant)
    try:
        if not conflicts_table_exists(conn):
            return 0
        with conn.transaction():  # a savepoint when the caller has a transaction open
            row = conn.execute(query, params).fetchone()
    except pg_errors.InsufficientPrivilege:
        raise StateError(f"role {_role(conn)} may not read {QUALIFIED}, so CONFLICTs recorded by runs cannot be "
                         f"counted: GRANT SELECT ON {QUALIFIED} TO {_role(conn)} (and USAGE ON SCHEMA "
                         f"{SCHEMA})") from None
    except psycopg.Error as e:
        raise StateError(f"cannot read {QUALIFIED} ({describe_db_error(e)})") from None
    return int(row[0]) if row else 0
