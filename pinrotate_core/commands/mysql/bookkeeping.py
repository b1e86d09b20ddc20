"""What pinrotate records for itself on MySQL / MariaDB, and what it decides from it, as
``key_checks.py`` and ``conflicts.py`` do on PostgreSQL (the SQL is in ``engines/mysql/bookkeeping.py``).

Where: the ``pinrotate`` database of the server (MySQL's databases are PostgreSQL's schemas), in
the tables ``pinrotate.key_checks`` and ``pinrotate.conflicts``; each row names the URL's database,
so that two databases of one server keep their records apart as they would on PostgreSQL.

- Key identity: a run records a non-secret check value per key id before its first write (a dry
  run and a gate only compare); a keyring whose key of a recorded id has other material is refused
  (``KeyIdentityMismatch``, exit 2) before anything is written or answered.
- CONFLICTs of ``fpc1`` targets (the ``cas`` scheme): recorded after each target's drain with the
  same rules as on PostgreSQL (a complete run replaces what it covered, an incomplete one keeps the
  larger count); read by every inventory and gate. Fail closed: a table that cannot be read blocks
  the target (conflicts we cannot see might exist); a run that cannot record them, or create the
  table before its first write, stops fail-closed or is refused with the privilege to grant.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Final

import pymysql

from ...config import Settings
from ...conflicts import NO_TENANT, StateError
from ...drain.results import DrainResult
from ...engines.mysql import bookkeeping as books
from ...engines.mysql.catalog import current_role
from ...engines.mysql.connect import MySqlConnection, describe_db_error, error_number
from ...engines.mysql.grants import account
from ...errors import DatabaseError, RefusedToStart
from ...key_checks import KeyIdentity, compare_recorded, key_checks_for
from ...keyring import Keyring
from ...log import log_event
from ...providers import KeyProvider
from ...schemes.base import Scheme

KEY_CHECKS: Final = books.qualified(books.KEY_CHECKS)
CONFLICTS: Final = books.qualified(books.CONFLICTS)
_CONFLICTS_LOCK: Final = "pinrotate.conflicts"
_KEY_CHECKS_LOCK: Final = "pinrotate.key_checks"
# ER_OPTION_PREVENTS_STATEMENT (--read-only), ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
_READ_ONLY: Final = frozenset({1290, 1792})


def _role(conn: MySqlConnection) -> str:
    """The connection's account as a GRANT names it (``'app'@'%'``: ``CURRENT_USER()``'s bare
    ``app@%`` is a syntax error there), so that the statements of a refusal run as printed."""
    try:
        user, _, host = current_role(conn).rpartition("@")
    except pymysql.err.MySQLError:
        return "?"
    return account(user, host).replace("%%", "%")  # printed for the mysql client, not run with parameters


# MySQL refuses a role alike whether a table it has no privilege on exists or not, and refuses a
# GRANT on a table that does not exist: the advice says when the GRANT runs.
_ONCE_IT_EXISTS: Final = " (once the table exists: grants prints its DDL)"


def _grant(privileges: str, table: str, role: str) -> str:
    return f"GRANT {privileges} ON {books.DATABASE}.{table} TO {role}"


# --- key identity ---------------------------------------------------------------------------------


def confirm_key_identity_mysql(conn: MySqlConnection, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
                               record: bool, run_id: str | None = None, quiet: bool = False) -> KeyIdentity:
    """``key_checks.confirm_key_identity`` on MySQL: compare every key of ``keyring`` with the
    check value recorded for its id; ``record``: first record the ids nothing was recorded for.
    ``conn`` is in autocommit mode (not inside a snapshot). ``quiet``: as ``confirm_key_identity``'s
    (the CLI's check before the run: what it finds is logged at DEBUG)."""
    checks = key_checks_for(settings, keyring, provider)
    if not checks:
        return KeyIdentity()
    by = f"host {socket.gethostname()}" + (f" run {run_id}" if run_id else "")
    try:
        database = books.database_of(conn)
        if not record and not books.table_exists(conn, books.KEY_CHECKS):
            return KeyIdentity(not_recorded=[c.key_id for c in checks])
        if record:
            _ensure_key_checks(conn)
        with books.writing(conn, _KEY_CHECKS_LOCK):
            ids = [c.key_id for c in checks]
            recorded = books.read_key_checks(conn, database, checks[0].keyring, ids)
            new = [c for c in checks if c.key_id not in recorded] if record else []
            if new:  # under the lock: nobody else of pinrotate records them meanwhile
                books.insert_key_checks(conn, database, checks[0].keyring, by,
                                        [(c.key_id, c.check_value, c.algorithm) for c in new])
                recorded = books.read_key_checks(conn, database, checks[0].keyring, ids)
            identity = compare_recorded(checks, recorded, by)
            identity.recorded_now = [c.key_id for c in new]
    except pymysql.err.MySQLError as e:
        role = _role(conn)
        if error_number(e) in books.DENIED:
            grant = "SELECT, INSERT" if record else "SELECT"
            raise RefusedToStart(f"role {role} may not {'write' if record else 'read'} {KEY_CHECKS}, where pinrotate "
                                 f"checks that each key id is one key: {_grant(grant, books.KEY_CHECKS, role)}"
                                 f"{_ONCE_IT_EXISTS}; nothing was written") from None
        if error_number(e) in _READ_ONLY:
            raise RefusedToStart(f"the database connection is read-only: a run cannot record its keys' check values "
                                 f"in {KEY_CHECKS}; nothing was written") from None
        raise DatabaseError(f"cannot check the keys against {KEY_CHECKS} ({describe_db_error(e)})") from None
    except TimeoutError as e:
        raise DatabaseError(f"cannot check the keys against {KEY_CHECKS} ({e})") from None
    news = bool(identity.recorded_now or identity.not_recorded)
    log_event("key_checks", level=logging.INFO if news and not quiet else logging.DEBUG, run_id=run_id,
              keyring=checks[0].keyring, compared=len(identity.compared), recorded=identity.recorded_now or None,
              not_recorded=identity.not_recorded or None)
    return identity


def _ensure_key_checks(conn: MySqlConnection) -> None:
    """Create ``pinrotate.key_checks`` unless it exists. MySQL refuses a role without privileges on
    the table alike whether it exists or not: such a role tries to create it (harmless where it
    exists), so that a refusal names CREATE, never a grant on a table that may not exist."""
    try:
        if books.table_exists(conn, books.KEY_CHECKS):
            return
        hidden = False
    except pymysql.err.MySQLError as e:
        if error_number(e) not in books.DENIED:
            raise
        hidden = True
    _create(conn, books.KEY_CHECKS, "a check value per key id", hidden=hidden)


def _create(conn: MySqlConnection, table: str, what: str, *, hidden: bool = False) -> None:
    """Create ``pinrotate.<table>`` (and the database); refused with the privilege to grant.
    ``hidden``: the role could not tell whether the table exists (then it may only need to use it)."""
    try:
        books.create(conn, table)
    except pymysql.err.MySQLError as e:
        if error_number(e) not in books.DENIED:
            raise
        role = _role(conn)
        ahead = (f"or, if it exists or is created ahead (grants prints its DDL), "
                 f"{_grant('SELECT, INSERT', table, role)}" if hidden else "or create it ahead (grants prints its DDL)")
        raise RefusedToStart(
            f"role {role} may not create {books.qualified(table)}, where pinrotate records {what}: "
            f"GRANT CREATE ON {books.DATABASE}.* TO {role}, {ahead}; nothing was written") from None


# --- CONFLICTs ------------------------------------------------------------------------------------


def ensure_conflicts_table_mysql(conn: MySqlConnection) -> None:
    """Before a run's first write: where it will record its CONFLICTs exists (StateError, with the
    privilege to grant, when the role may not create it)."""
    try:
        if not books.table_exists(conn, books.CONFLICTS):
            books.create(conn, books.CONFLICTS)
    except pymysql.err.MySQLError as e:
        role = _role(conn)
        if error_number(e) in books.DENIED:
            raise StateError(f"role {role} may not create {CONFLICTS}, where pinrotate records CONFLICTs for the "
                             f"gate: GRANT CREATE ON {books.DATABASE}.* TO {role}, or create it ahead (grants prints "
                             "its DDL)") from None
        raise StateError(f"cannot create {CONFLICTS} ({describe_db_error(e)})") from None


def record_conflicts_mysql(conn: MySqlConnection, target: str, by_tenant: Mapping[str, int], *,
                           tenant_scope: str | None, complete: bool, run_id: str, shard: bool = False) -> None:
    """``conflicts.record_conflicts`` on MySQL (one transaction, committed before it returns): a
    complete run replaces what it covered (all tenants, or its one tenant); an incomplete one
    clears nothing and keeps, per tenant, the larger of the stored count and its own. One
    ``shard`` of a run (an id range) clears nothing and adds its counts to those its sibling
    shards of the same ``run_id`` recorded (the larger, against an earlier run's)."""
    found = {t: n for t, n in by_tenant.items() if n > 0}
    try:
        if not found and not books.table_exists(conn, books.CONFLICTS):
            return  # nothing to add, and nothing was ever recorded to clear
        if not books.table_exists(conn, books.CONFLICTS):
            books.create(conn, books.CONFLICTS)
        database = books.database_of(conn)
        with books.writing(conn, _CONFLICTS_LOCK):
            if complete and not shard:
                books.delete_conflicts(conn, database, target, tenant_scope)
            if tenant_scope is not None:
                found = {t: n for t, n in found.items() if t == tenant_scope}
            books.upsert_conflicts(conn, database, target, found, run_id, add_within_run=shard)
    except pymysql.err.MySQLError as e:
        role = _role(conn)
        if error_number(e) in books.DENIED:
            raise StateError(f"role {role} may not write {CONFLICTS}: "
                             f"{_grant('SELECT, INSERT, UPDATE, DELETE', books.CONFLICTS, role)}") from None
        raise StateError(f"cannot record the CONFLICTs of target {target} in {CONFLICTS} "
                         f"({describe_db_error(e)})") from None
    except TimeoutError as e:
        raise StateError(f"cannot record the CONFLICTs of target {target} in {CONFLICTS} ({e})") from None


def last_conflicts_mysql(conn: MySqlConnection, target: str, *, tenant: str | None = None) -> int:
    """CONFLICT count of ``target`` left by the last runs (one tenant's, or every tenant's). No
    table: no run ever had one to record (a run creates it before its first write). A table the
    role may not read is a StateError: conflicts we cannot see might exist."""
    try:
        if not books.table_exists(conn, books.CONFLICTS):
            return 0
        return books.sum_conflicts(conn, books.database_of(conn), target, tenant)
    except pymysql.err.MySQLError as e:
        role = _role(conn)
        if error_number(e) in books.DENIED:
            raise StateError(f"role {role} may not read {CONFLICTS}, so CONFLICTs recorded by runs cannot be "
                             f"counted: {_grant('SELECT', books.CONFLICTS, role)}{_ONCE_IT_EXISTS}") from None
        raise StateError(f"cannot read {CONFLICTS} ({describe_db_error(e)})") from None


def record_drain_conflicts(conn: MySqlConnection, scheme: Scheme, result: DrainResult, *, tenant: str | None,
                           run_id: str) -> None:
    """After a non-dry drain of a ``cas`` target (fpc1): its CONFLICTs for the gate. A failure to
    record leaves the target fail-closed (``state_error``: exit 4), as on PostgreSQL."""
    if scheme.guard != "cas":
        return
    try:
        record_conflicts_mysql(conn, result.target, result.conflicts_by_tenant, tenant_scope=tenant,
                               complete=result.stopped is None, run_id=run_id)
    except StateError as e:
        result.state_error = str(e)
        result.error = result.error or f"target {result.target}: {e}"
        log_event("state_not_saved", level=40, run_id=run_id, target=result.target, error=str(e))


def tenant_key(tenant: object) -> str:
    """The tenant a CONFLICT is recorded under (``conflicts.NO_TENANT`` for none)."""
    return NO_TENANT if tenant is None else str(tenant)
