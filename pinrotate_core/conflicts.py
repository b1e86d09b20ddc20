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

from .db import describe_db_error
from .engines.postgresql import bookkeeping as pg
from .errors import PinrotateError

NO_TENANT: Final = ""  # the tenant key of targets without a tenant column (and of rows whose tenant is NULL)
SCHEMA: Final = pg.SCHEMA
TABLE: Final = pg.CONFLICTS
QUALIFIED: Final = f"{SCHEMA}.{TABLE}"
# Serialises pinrotate's writers of the table (creation included) across processes and hosts.
_LOCK_KEY: Final = "pinrotate.conflicts"

# The whole DDL pinrotate ever runs (docs/reference.md, "The pinrotate.conflicts table"); the
# room's, printed ahead by grants.py.
CREATE_SQL: Final = pg.CREATE_TABLES[TABLE]


class StateError(PinrotateError):
    """The CONFLICT records cannot be read or written."""


def conflicts_table_exists(conn: psycopg.Connection[Any]) -> bool:
    """Is there a ``pinrotate.conflicts`` table?"""
    return pg.table_exists(conn, TABLE)


def ensure_conflicts_table(conn: psycopg.Connection[Any]) -> None:
    """Create ``pinrotate.conflicts`` unless it exists (in its own transaction; ``conn`` is in
    autocommit mode). StateError with the privilege to grant when the role may not."""
    try:
        pg.create_once(conn, TABLE, _LOCK_KEY)
    except pg_errors.InsufficientPrivilege:
        role = pg.current_role(conn)
        raise StateError(
            f"role {role} may not create {QUALIFIED}, where pinrotate records CONFLICTs for the gate: "
            f"GRANT CREATE ON DATABASE {conn.info.dbname} TO {role}, or create it ahead "
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
        with pg.transaction(conn, durable=True, lock=_LOCK_KEY):
            if shard:
                found = {t: n for t, n in found.items() if tenant_scope is None or t == tenant_scope}
                pg.upsert_conflicts(conn, target, found, run_id, add_within_run=True)
                return
            if complete:
                pg.delete_conflicts(conn, target, tenant_scope)
                if tenant_scope is not None:
                    found = {t: n for t, n in found.items() if t == tenant_scope}
            pg.upsert_conflicts(conn, target, found, run_id, add_within_run=False)
    except StateError:
        raise
    except pg_errors.InsufficientPrivilege:
        role = pg.current_role(conn)
        raise StateError(f"role {role} may not write {QUALIFIED}: GRANT SELECT, INSERT, UPDATE, DELETE "
                         f"ON {QUALIFIED} TO {role} (and USAGE ON SCHEMA {SCHEMA})") from None
    except psycopg.Error as e:
        raise StateError(f"cannot record the CONFLICTs of target {target} in {QUALIFIED} "
                         f"({describe_db_error(e)})") from None


def last_conflicts(conn: psycopg.Connection[Any], target: str, *, tenant: str | None = None) -> int:
    """CONFLICT count of ``target`` left by the last runs: one tenant's, or every tenant's.

    No table: no run ever had a conflict to record (a run creates it before its first write). A
    table this role may not read is a StateError: conflicts we cannot see might exist.
    """
    try:
        if not conflicts_table_exists(conn):
            return 0
        return pg.sum_conflicts(conn, target, tenant)
    except pg_errors.InsufficientPrivilege:
        role = pg.current_role(conn)
        raise StateError(f"role {role} may not read {QUALIFIED}, so CONFLICTs recorded by runs cannot be "
                         f"counted: GRANT SELECT ON {QUALIFIED} TO {role} (and USAGE ON SCHEMA "
                         f"{SCHEMA})") from None
    except psycopg.Error as e:
        raise StateError(f"cannot read {QUALIFIED} ({describe_db_error(e)})") from None
