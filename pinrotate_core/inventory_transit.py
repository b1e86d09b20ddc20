"""Inventory of ``vault-transit`` targets: how many values sit on which Transit key version.

Versions are read from each value's ``vault:v<N>:`` prefix inside PostgreSQL, so only counts leave
the database. It never decrypts (not even for ``deep``: that would bring every plaintext into this
process through Transit) and never returns or logs a value.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from .config import KeysSettings
from .inventory import TargetInventory, blocked_inventory, register_format
from .inventory_fpc1 import live_condition
from .keyring import Keyring
from .targets import Column, ResolvedTarget

# Column types a vault:v<N>: value can live in (text forms, or its ASCII bytes in bytea).
TRANSIT_COLUMN_TYPES = frozenset({"text", "varchar", "bpchar", "bytea"})
# formats/transit.py's pattern for PostgreSQL's regex engine: the whole value must be
# ``vault:v<N>:`` + padded standard base64 (what ``transit_version`` accepts); group 1 is N.
TRANSIT_VALUE_PATTERN = (
    r"^vault:v([1-9][0-9]{0,9}):(?:[A-Za-z0-9+/]{4})*"
    r"(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=|[A-Za-z0-9+/]{4})$"
)


def _column_ref(column: Column, alias: str | None = None) -> sql.Composable:
    return sql.Identifier(alias, column.name) if alias else sql.Identifier(column.name)


def stored_version_sql(column: Column, alias: str | None = None) -> sql.Composable:
    """SQL for the key version a stored value names: NULL when the value is NULL or not ``vault:v<N>:``."""
    ref = _column_ref(column, alias)
    # A bytea column holds the ASCII text; 'escape' keeps ASCII as it is and escapes anything else,
    # which then fails the pattern (UNKNOWN), as it would in transit_version().
    text = sql.SQL("encode({}, 'escape')").format(ref) if column.type_name == "bytea" else sql.SQL("{}::text").format(ref)
    return sql.SQL("(substring({} from {}))::int8").format(text, sql.Literal(TRANSIT_VALUE_PATTERN))


def lowest_version_sql(target: ResolvedTarget, alias: str | None = None) -> sql.Composable:
    """The lowest key version among a row's values (LEAST skips NULLs: NULL and unparseable values)."""
    return sql.SQL("LEAST({})").format(sql.SQL(", ").join(stored_version_sql(c, alias) for c in target.columns))


def scope_sql(target: ResolvedTarget, tenant: str | None, alias: str | None = None) -> sql.Composable:
    """Rows in scope: every ``require_not_null`` column set, not soft-deleted (the fpc1 rule), and,
    when asked, only ``tenant``'s rows. NULL counts as out of scope."""
    t = target.settings

    def ident(column: str) -> sql.Identifier:
        return sql.Identifier(alias, column) if alias else sql.Identifier(column)

    conds: list[sql.Composable] = [sql.SQL("{} IS NOT NULL").format(ident(c)) for c in t.require_not_null]
    conds.append(live_condition(t, alias))
    if tenant is not None and t.tenant:
        # Inlined as hex: these conditions are composed into statements with and without bound
        # parameters, and a '%' in a plain literal would read as a placeholder in the first kind.
        conds.append(sql.SQL("{}::text = convert_from(decode({}, 'hex'), 'UTF8')").format(
            ident(t.tenant), sql.Literal(tenant.encode().hex())))
    return sql.SQL("COALESCE(({}), false)").format(sql.SQL(" AND ").join(conds))


def classify_transit_version(version: int, current: int, min_decryption_version: int) -> str:
    """ACTIVE on the latest version; HISTORICAL while Transit can still decrypt it; UNKNOWN_KEY below
    ``min_decryption_version``; NEWER above the latest version read at the start (a rotation since)."""
    if version == current:
        return "ACTIVE"
    if version > current:
        return "NEWER"
    return "HISTORICAL" if version >= min_decryption_version else "UNKNOWN_KEY"


@register_format("vault-transit")
def inventory_transit(conn: psycopg.Connection[Any], target: ResolvedTarget, keyring: Keyring, deep: bool,
                      tenant: str | None, keys: KeysSettings) -> TargetInventory:
    """Counts values (a row with two encrypted columns counts twice), by the version in their prefix.

    The prefix, not the key-version column, is what Transit decrypts with, so it is what the gate
    must see; rows whose key-version column already says current while a value is older are
    counted in ``transit_rows_behind_key_version`` (the drain selects by that column and would
    not take them). ``deep`` changes nothing: FAILED stays 0, because checking that a value
    decrypts would mean asking Transit for its plaintext; the drain records the values Transit
    refuses as FAILED rows instead.
    """
    t = target.settings
    if not keyring.server_side:
        return blocked_inventory(t, "format vault-transit needs keys.provider = vault-transit")
    odd = [c.name for c in target.columns if c.type_name not in TRANSIT_COLUMN_TYPES]
    if odd:
        return blocked_inventory(t, f"vault-transit cipher columns must be text, varchar or bytea ({', '.join(odd)} is not)")
    inv = TargetInventory(t.name, t.format)
    current = keyring.current_version
    oldest = keyring.min_decryption_version or 1
    per_value = sql.SQL(", ").join(
        sql.SQL("({}, {} IS NOT NULL)").format(stored_version_sql(c, "t"), _column_ref(c, "t")) for c in target.columns
    )
    rows = conn.execute(
        sql.SQL(
            "SELECT v.pinrotate_version, {scope}, count(*) FROM {rel} AS t "
            "CROSS JOIN LATERAL (VALUES {per_value}) AS v(pinrotate_version, pinrotate_present) "
            "WHERE v.pinrotate_present GROUP BY 1, 2"
        ).format(scope=scope_sql(target, tenant, "t"), rel=target.relation, per_value=per_value)
    ).fetchall()
    for version, scoped, n in rows:
        inv.total += n
        if not scoped:
            inv.add("EXCLUDED", n)
            if version is not None:
                inv.excluded_by_key[str(version)] = inv.excluded_by_key.get(str(version), 0) + n
            continue
        if version is None:
            inv.add("UNKNOWN", n)
            continue
        inv.by_key[str(version)] = inv.by_key.get(str(version), 0) + n
        inv.add(classify_transit_version(int(version), current, oldest), n)
    inv.extra["transit_latest_version"] = current
    inv.extra["transit_min_decryption_version"] = oldest
    if t.key_version:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {rel} AS t WHERE {scope} AND t.{kv} >= %s AND {lowest} < %s").format(
                rel=target.relation, scope=scope_sql(target, tenant, "t"), kv=sql.Identifier(t.key_version),
                lowest=lowest_version_sql(target, "t")),
            (current, current),
        ).fetchone()
        inv.extra["transit_rows_behind_key_version"] = int(row[0]) if row else 0
    return inv
