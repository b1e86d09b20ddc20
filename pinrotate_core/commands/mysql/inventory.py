"""``inventory`` (and ``--deep``) on MySQL / MariaDB: the counts of ``inventory.py``, value by value.

Every target is resolved over the room's catalog (``.targets``), its rows streamed (PyMySQL's
unbuffered cursor) with the scope rule composed from the room's SQL pieces (``scope_text``), and
each value classified (and with ``deep`` decrypted) by the same scheme as on PostgreSQL; what the
rows read and the facts a scheme counts (``counted_facts``) are the scheme's SQL, composed of the
room's pieces as on PostgreSQL. The whole
inventory reads one consistent snapshot (``START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY``).
Counts and locations only, never a value; nothing is written.

CONFLICT (``fpc1``) is what the last runs recorded in ``pinrotate.conflicts`` (``.bookkeeping``);
a table the role may not read blocks the target.

Not counted in the database as on PostgreSQL (where a scheme can name a row's key in SQL): every
row is read, which costs time, not correctness.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pymysql
import sqlalchemy as sa
from pymysql.cursors import SSCursor

from ...config import Settings, TargetSettings
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql import gate as mysql_gate
from ...engines.mysql.connect import LOCK_WAIT_TIMEOUT, MySqlConnection, TableLockedByDdl
from ...engines.mysql.gate import GATE_CHECKS, changed_since_snapshot
from ...engines.mysql.operations import OPERATIONS as ops
from ...errors import DatabaseError
from ...inventory import (
    Inventory,
    TargetInventory,
    bind_for_inventory,
    blocked_inventory,
    capacity_reason,
    conclude_target,
)
from ...keyring import Keyring
from ...reading_start import start_reading
from ...schemes.base import LEGACY_KEY, InventoryFacts, Scheme
from ...scope_text import exclusion_rule, scope_condition
from ...targets import Column
from .bookkeeping import last_conflicts_mysql
from .targets import resolve_mysql_target

FETCH_ROWS = 2000
ALIAS = "t"


def mysql_inventory(settings: Settings, *, deep: bool = False, tenant: str | None = None) -> Inventory:
    """``inventory`` on a MySQL / MariaDB URL (the server reached first: exit 4 when it is not)."""
    start = start_reading(settings, tenant, pool_size=1)
    try:
        return take_mysql_inventory(start.engine, start.settings, start.keyring, deep=deep, tenant=tenant,
                                    provider=start.provider)
    finally:
        start.engine.dispose()


def take_mysql_inventory(engine: sa.Engine, settings: Settings, keyring: Keyring, *, deep: bool = False,
                         tenant: str | None = None, targets: Sequence[TargetSettings] | None = None,
                         provider: object = None) -> Inventory:
    with mysql_connect.raw_connection(engine) as conn, GATE_CHECKS.snapshot(conn):
        return inventory_on_mysql(conn, settings, keyring, deep=deep, tenant=tenant, targets=targets,
                                  provider=provider)


def inventory_on_mysql(conn: MySqlConnection, settings: Settings, keyring: Keyring, *, deep: bool = False,
                       tenant: str | None = None, targets: Sequence[TargetSettings] | None = None,
                       provider: object = None, gate: bool = False) -> Inventory:
    """The inventory inside ``conn``'s consistent snapshot (``GATE_CHECKS.snapshot``). A target the
    snapshot cannot read as it was is BLOCKED, named: never read as empty, and the other targets are
    still counted. ``gate``: the gate's look, where a target held by DDL past the snapshot's metadata
    lock wait is BLOCKED too (the gate closed, as on PostgreSQL); elsewhere that is a DatabaseError
    naming the table (exit 4), as every command's statement behind DDL is."""
    chosen = list(settings.targets if targets is None else targets)
    result = Inventory(keyring.current, {}, deep=deep, tenant=tenant)
    for t in chosen:
        try:
            result.targets[t.name] = _target_inventory(conn, t, settings, keyring, deep=deep, tenant=tenant,
                                                       provider=provider)
        except TableLockedByDdl as e:  # its privileges' check waited for the DDL
            if not gate:
                raise
            result.targets[t.name] = _locked(t, e.cause)
        except pymysql.err.MySQLError as e:
            changed = changed_since_snapshot(e)
            if gate and changed is None and mysql_connect.error_number(e) == LOCK_WAIT_TIMEOUT:
                result.targets[t.name] = _locked(t, mysql_connect.describe_db_error(e))
                continue
            if changed is None:
                raise DatabaseError(f"inventory of target {t.name} failed ({mysql_connect.describe_db_error(e)})"
                                    ) from None
            # InnoDB's snapshot does not hold DDL back: the table under this name is another one now.
            result.targets[t.name] = blocked_inventory(t, f"{t.table} is not the one it was at the gate's snapshot: "
                                                          f"{changed}; look again")
    return result


def _locked(t: TargetSettings, cause: str) -> TargetInventory:
    """BLOCKED: the target is held by an ALTER or ``LOCK TABLES ... WRITE`` past the snapshot's
    metadata lock wait. The statement alone failed; the snapshot goes on with the other targets, as
    PostgreSQL's lock_timeout does in the gate's look."""
    return blocked_inventory(t, f"cannot read {t.table} ({cause}): locked by DDL past {mysql_gate.LOCK_WAIT_S} s; "
                                "run the gate again")


def _target_inventory(conn: MySqlConnection, t: TargetSettings, settings: Settings, keyring: Keyring, *,
                      deep: bool, tenant: str | None, provider: object) -> TargetInventory:
    bound = bind_for_inventory(lambda t: resolve_mysql_target(conn, t, writing=False), t, keyring, settings, provider)
    if isinstance(bound, TargetInventory):
        return bound
    _, scheme = bound
    inv = inventory_target(conn, scheme, deep=deep, tenant=tenant)
    if t.tenant:
        inv.extra["tenants"] = tenants_in_scope(conn, t, tenant)
    return inv


def stream(conn: MySqlConnection, statement: str, params: Sequence[Any] = ()) -> Iterator[tuple[Any, ...]]:
    """The rows of ``statement`` in one unbuffered pass (PyMySQL's ``SSCursor``), ``FETCH_ROWS`` at a
    time; always run with a parameter tuple, so the quoted names' ``%%`` become ``%``."""
    cursor = conn.cursor(SSCursor)
    try:
        cursor.execute(statement, tuple(params))
        while rows := cursor.fetchmany(FETCH_ROWS):
            yield from rows
    finally:
        cursor.close()


def inventory_target(conn: MySqlConnection, scheme: Scheme, *, deep: bool = False,
                     tenant: str | None = None) -> TargetInventory:
    target = scheme.target
    t = target.settings
    inv = TargetInventory(t.name, t.format)
    rel = ops.relation(t.schema_name, t.table_name, ALIAS)
    rule = exclusion_rule(t, tenant, ops, ALIAS)
    # Where PostgreSQL counts a row's key in SQL, an out-of-scope row whose key is NULL while it
    # holds a value is UNKNOWN, not EXCLUDED: what it is under cannot be told (inventory.py).
    keyed_rows = scheme.value_keys_sql(ops, ALIAS) is not None
    n_cols = len(target.columns)
    # Facts the scheme counts over the in-scope rows, in the same SQL as on PostgreSQL: one
    # column each, before the values.
    facts = scheme.counted_facts(ops, ALIAS) if isinstance(scheme, InventoryFacts) else {}
    if isinstance(scheme, InventoryFacts):
        inv.extra.update(scheme.inventory_facts())
    inv.extra.update(dict.fromkeys(facts, 0))
    holds = [f"({condition}) IS TRUE" for condition in facts.values()]
    n_facts = len(holds)
    for row in stream(conn, f"SELECT {', '.join([rule, *holds, *scheme.read_list(ops, ALIAS)])} FROM {rel}"):
        excluded_by, values = row[0], row[1 + n_facts:]
        if excluded_by is None:
            for fact, held in zip(facts, row[1:1 + n_facts]):
                inv.extra[fact] += int(held)
        for value, failed in scheme.inspect(values, deep and excluded_by is None):
            if excluded_by is not None and keyed_rows and value.key is None \
                    and any(v is not None for v in values[-n_cols:]):
                inv.total += 1
                inv.add("UNKNOWN")
                continue
            inv.count(value, excluded_by)
            if failed:
                inv.add("FAILED")
                inv.failed_by_key[value.key or LEGACY_KEY] = inv.failed_by_key.get(value.key or LEGACY_KEY, 0) + 1
    # fpc1: the CONFLICTs the last runs recorded in the server's pinrotate.conflicts
    return conclude_target(inv, scheme, lambda: last_conflicts_mysql(conn, t.name, tenant=tenant),
                           lambda: capacity_blocker(conn, scheme, tenant))


def capacity_blocker(conn: MySqlConnection, scheme: Scheme, tenant: str | None = None) -> str | None:
    """Why the target is BLOCKED for lack of room (a ``varchar(n)`` too narrow): ``inventory``'s
    ``capacity_reason``, reading MySQL."""
    t = scheme.target.settings

    def longer_than(column: Column, shortest: int) -> Iterable[Any]:
        col = ops.column(column.name, ALIAS)
        statement = (f"SELECT {col} FROM {ops.relation(t.schema_name, t.table_name, ALIAS)}"
                     f" WHERE {scope_condition(t, tenant, ops, ALIAS)} AND {col} IS NOT NULL"
                     f" AND CHAR_LENGTH({col}) > %s")
        with conn.cursor() as cur:
            cur.execute(statement, (shortest,))
            return [stored for (stored,) in cur.fetchall()]

    return capacity_reason(scheme, longer_than)


def tenants_in_scope(conn: MySqlConnection, t: TargetSettings, tenant: str | None) -> list[str]:
    if tenant is not None:
        return [tenant]
    col = ops.text_of(ops.quote(t.tenant or ""))
    with conn.cursor() as cur:
        cur.execute(f"SELECT DISTINCT {col} FROM {ops.relation(t.schema_name, t.table_name)}"
                    f" WHERE {ops.quote(t.tenant or '')} IS NOT NULL ORDER BY 1", ())
        return [str(r[0]) for r in cur.fetchall()]
