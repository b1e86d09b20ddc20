"""``inventory`` (and ``--deep``) on MySQL / MariaDB: the counts of ``inventory.py``, value by value.

Every target is resolved over the room's catalog (``.targets``), its rows streamed (PyMySQL's
unbuffered cursor) with the scope rule composed from the room's SQL pieces (``scope_text``), and
each value classified (and with ``deep`` decrypted) by the same scheme as on PostgreSQL. The whole
inventory reads one consistent snapshot (``START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY``).
Counts and locations only, never a value; nothing is written.

CONFLICT (``fpc1``) is what the last runs recorded in ``pinrotate.conflicts`` (``.bookkeeping``);
a table the role may not read blocks the target.

Not counted in the database as on PostgreSQL (where a scheme can name a row's key in SQL): every
row is read, which costs time, not correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pymysql
import sqlalchemy as sa
from pymysql.cursors import SSCursor

from ...config import Settings, TargetSettings
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql.connect import MySqlConnection
from ...engines.mysql.gate import GATE_CHECKS
from ...engines.mysql.operations import OPERATIONS as ops
from ...errors import DatabaseError
from ...inventory import Inventory, TargetInventory, bind_for_inventory, capacity_reason, conclude_target
from ...keyring import Keyring
from ...reading_start import start_reading
from ...schemes.base import LEGACY_KEY, InventoryFacts, Scheme
from ...schemes.transit import TransitScheme, transit_version_or_none
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
                       provider: object = None) -> Inventory:
    chosen = list(settings.targets if targets is None else targets)
    result = Inventory(keyring.current, {}, deep=deep, tenant=tenant)
    for t in chosen:
        bound = bind_for_inventory(lambda t: resolve_mysql_target(conn, t, writing=False), t, keyring, settings,
                                   provider)
        if isinstance(bound, TargetInventory):
            result.targets[t.name] = bound
            continue
        _, scheme = bound
        try:
            result.targets[t.name] = inventory_target(conn, scheme, deep=deep, tenant=tenant)
            if t.tenant:
                result.targets[t.name].extra["tenants"] = tenants_in_scope(conn, t, tenant)
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"inventory of target {t.name} failed ({mysql_connect.describe_db_error(e)})") from None
    return result


def read_list(scheme: Scheme, alias: str | None = ALIAS) -> list[str]:
    """What ``scheme.inspect`` reads per row, in MySQL: fpc1 the tenant and every column as text,
    the others the key version (or NULL) and every column as stored (bytes of a binary column)."""
    t = scheme.target.settings
    cols = [ops.column(c.name, alias) for c in scheme.target.columns]
    if t.format == "fpc1":
        tenant = ops.text_of(ops.column(t.tenant, alias)) if t.tenant else "NULL"
        return [tenant, *(ops.text_of(c) for c in cols)]
    kv = scheme.target.key_version
    return [ops.column(kv.name, alias) if kv is not None else "NULL", *cols]


def _stream(conn: MySqlConnection, statement: str) -> Iterator[tuple[Any, ...]]:
    cursor = conn.cursor(SSCursor)
    try:
        cursor.execute(statement, ())  # (): the quoted names' %% become %
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
    keyed_rows = scheme.value_keys_sql(ALIAS) is not None
    n_cols = len(target.columns)
    facts = counted_facts(scheme)
    if facts is None:
        # Counted in SQL by the scheme on PostgreSQL, and not known here: closed rather than guessed.
        inv.block(f"format {t.format}: its inventory facts are not available on MySQL / MariaDB yet (issue 32)")
        return inv
    if isinstance(scheme, InventoryFacts):
        inv.extra.update(scheme.inventory_facts())
    inv.extra.update(dict.fromkeys(facts, 0))
    for row in _stream(conn, f"SELECT {rule}, {', '.join(read_list(scheme))} FROM {rel}"):
        excluded_by, values = row[0], row[1:]
        if excluded_by is None:
            for fact, holds in facts.items():
                if holds(values):
                    inv.extra[fact] += 1
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


def counted_facts(scheme: Scheme) -> dict[str, Callable[[Sequence[Any]], bool]] | None:
    """The facts a scheme counts over the in-scope rows (``InventoryFacts.counted_facts``, SQL on
    PostgreSQL), as tests of one row read by ``read_list`` (key version, values...); None when a
    fact is not known here (the target is then BLOCKED, never reported without it)."""
    if not isinstance(scheme, InventoryFacts):
        return {}
    wanted = set(scheme.counted_facts(ALIAS))
    known: dict[str, Callable[[Sequence[Any]], bool]] = {}
    if isinstance(scheme, TransitScheme):
        current = scheme.current

        def behind_key_version(row: Sequence[Any]) -> bool:
            """Its key-version column says current while a value is older: the drain would not take it."""
            versions = [v for v in (transit_version_or_none(x) for x in row[1:]) if v is not None]
            return row[0] is not None and int(row[0]) >= current and bool(versions) and min(versions) < current

        known["transit_rows_behind_key_version"] = behind_key_version
    if not wanted <= set(known):
        return None
    return {name: known[name] for name in sorted(wanted)}


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
