"""Inventory: read-only counts per target and key, the evidence the retire gate decides on.

Counts and locations only (contract §6): never a value. ``aesgcm`` counts rows, ``fpc1`` counts
values. ``deep`` also decrypts every value to find the ones that do not (FAILED).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from .config import KeysSettings, Settings, TargetSettings
from .db import describe_db_error, raw_connection
from .errors import CiphertextInvalid, DatabaseError, TargetBlocked
from .formats.aesgcm import AesGcmCipherSet
from .keyring import Keyring, is_version
from .targets import ResolvedTarget, resolve_target

CATEGORIES = ("ACTIVE", "HISTORICAL", "NEWER", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "EXCLUDED", "FAILED",
              "CONFLICT", "BLOCKED")
DEEP_FETCH_ROWS = 5000


@dataclass
class TargetInventory:
    target: str
    format: str
    total: int = 0
    by_key: dict[str, int] = field(default_factory=dict)  # in-scope rows/values per key
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    excluded_by_key: dict[str, int] = field(default_factory=dict)  # out of scope, still on a key
    failed_by_key: dict[str, int] = field(default_factory=dict)
    blocked_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # format-specific facts (e.g. transit versions)

    def add(self, category: str, n: int = 1) -> None:
        self.counts[category] += n

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"total": self.total, "by_key": dict(sorted(self.by_key.items()))}
        out.update(self.counts)
        if self.blocked_reason:
            out["blocked_reason"] = self.blocked_reason
        out.update(self.extra)
        return out


@dataclass
class Inventory:
    current_key: str
    targets: dict[str, TargetInventory]
    deep: bool = False
    tenant: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"current_key": self.current_key,
                               "targets": {n: t.as_dict() for n, t in self.targets.items()}}
        if self.tenant is not None:
            out["tenant"] = self.tenant
        if self.deep:
            out["deep"] = True
        return out

    def total(self, category: str) -> int:
        return sum(t.counts[category] for t in self.targets.values())


# Per-format inventory functions: (conn, resolved target, keyring, deep, tenant, [keys] settings)
# -> TargetInventory. The [keys] settings carry what a format may need to read values (fpc1: the
# legacy format).
InventoryFn = Callable[[psycopg.Connection[Any], ResolvedTarget, Keyring, bool, str | None, KeysSettings],
                       TargetInventory]
_BY_FORMAT: dict[str, InventoryFn] = {}


def register_format(fmt: str) -> Callable[[InventoryFn], InventoryFn]:
    def deco(fn: InventoryFn) -> InventoryFn:
        _BY_FORMAT[fmt] = fn
        return fn
    return deco


def classify_version(key_id: str, keyring: Keyring) -> str:
    """ACTIVE / HISTORICAL / NEWER / UNKNOWN_KEY for a value on integer key version ``key_id``."""
    if key_id not in keyring.keys and not keyring.server_side:
        return "UNKNOWN_KEY"
    current = keyring.current_version
    v = int(key_id)
    return "ACTIVE" if v == current else ("HISTORICAL" if v < current else "NEWER")


@register_format("aesgcm")
def inventory_aesgcm(conn: psycopg.Connection[Any], target: ResolvedTarget, keyring: Keyring, deep: bool,
                     tenant: str | None, keys: KeysSettings) -> TargetInventory:
    t = target.settings
    inv = TargetInventory(t.name, t.format)
    kv = sql.Identifier(t.key_version or "")
    in_scope = _scope_condition(t)
    rows = conn.execute(
        sql.SQL("SELECT {kv}::text, {scope}, count(*) FROM {rel} GROUP BY 1, 2").format(
            kv=kv, scope=in_scope, rel=target.relation)
    ).fetchall()
    for key_id, scoped, n in rows:
        inv.total += n
        if not scoped:
            inv.add("EXCLUDED", n)
            if key_id is not None:
                inv.excluded_by_key[key_id] = inv.excluded_by_key.get(key_id, 0) + n
            continue
        if key_id is None or not is_version(key_id):
            inv.add("UNKNOWN", n)  # in scope, but no key version to read it with
            continue
        inv.by_key[key_id] = inv.by_key.get(key_id, 0) + n
        inv.add(classify_version(key_id, keyring), n)
    if deep:
        _deep_aesgcm(conn, target, keyring, inv, in_scope)
    return inv


def _scope_condition(t: TargetSettings) -> sql.Composable:
    conds: list[sql.Composable] = [sql.SQL("{} IS NOT NULL").format(sql.Identifier(c)) for c in t.require_not_null]
    return sql.SQL(" AND ").join(conds) if conds else sql.SQL("true")


def _deep_aesgcm(conn: psycopg.Connection[Any], target: ResolvedTarget, keyring: Keyring, inv: TargetInventory,
                 in_scope: sql.Composable) -> None:
    """Decrypt every in-scope value with its row's key; count rows that do not decrypt (FAILED)."""
    t = target.settings
    ciphers = AesGcmCipherSet(keyring)
    query = sql.SQL("SELECT {kv}, {cols} FROM {rel} WHERE {kv} IS NOT NULL AND {scope}").format(
        kv=sql.Identifier(t.key_version or ""), cols=sql.SQL(", ").join(sql.Identifier(c) for c in t.columns),
        rel=target.relation, scope=in_scope)
    with conn.transaction(), conn.cursor(name="pinrotate_deep", binary=True) as cur:
        cur.itersize = DEEP_FETCH_ROWS
        cur.execute(query)
        for row in cur:
            key_id = str(row[0])
            if key_id not in keyring.keys:
                continue  # already UNKNOWN_KEY
            for enc, stored in zip(target.encodings, row[1:]):
                if stored is None:
                    continue
                try:
                    ciphers.decrypt(key_id, enc.to_bytes(stored))
                except CiphertextInvalid:
                    inv.add("FAILED")
                    inv.failed_by_key[key_id] = inv.failed_by_key.get(key_id, 0) + 1
                    break


def blocked_inventory(t: TargetSettings, reason: str) -> TargetInventory:
    inv = TargetInventory(t.name, t.format, blocked_reason=reason)
    inv.add("BLOCKED")
    return inv


def take_inventory(engine: sa.Engine, settings: Settings, keyring: Keyring, *, deep: bool = False,
                   tenant: str | None = None, targets: Sequence[TargetSettings] | None = None) -> Inventory:
    chosen = list(settings.targets if targets is None else targets)
    result = Inventory(keyring.current, {}, deep=deep, tenant=tenant)
    with raw_connection(engine) as conn:
        for t in chosen:
            try:
                resolved = resolve_target(conn, t)
            except TargetBlocked as e:
                result.targets[t.name] = blocked_inventory(t, e.reason)
                continue
            fn = _BY_FORMAT.get(t.format)
            if fn is None:
                result.targets[t.name] = blocked_inventory(t, f"format {t.format} has no inventory")
                continue
            try:
                result.targets[t.name] = fn(conn, resolved, keyring, deep, tenant, settings.keys)
                if t.tenant:
                    result.targets[t.name].extra["tenants"] = tenants_in_scope(conn, resolved, tenant)
            except psycopg.Error as e:
                raise DatabaseError(f"inventory of target {t.name} failed ({describe_db_error(e)})") from None
    return result


def tenants_in_scope(conn: psycopg.Connection[Any], target: ResolvedTarget, tenant: str | None) -> list[str]:
    """The tenants a target's counts cover (identifiers, for the gate report's tenant list)."""
    if tenant is not None:
        return [tenant]
    column = sql.Identifier(target.settings.tenant or "")
    query = sql.SQL("SELECT DISTINCT {col}::text FROM {rel} WHERE {col} IS NOT NULL ORDER BY 1").format(
        col=column, rel=target.relation)
    return [str(row[0]) for row in conn.execute(query).fetchall()]


from . import (
    inventory_fpc1,  # noqa: F401  (registers the fpc1 inventory)
    inventory_transit,  # noqa: F401  (registers the vault-transit inventory)
)
