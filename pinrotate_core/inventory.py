"""Inventory: read-only counts per target and key, the evidence the retire gate decides on.

One inventory for every scheme: it streams (or, where the scheme can name each value's key in SQL,
counts in the database) the values of every row, splits them by THE scope rule into in scope and
EXCLUDED (per rule that excluded them: the gate blocks on EXCLUDED values still on a key), and asks the scheme for each value's category; ``deep`` also decrypts every in-scope
value to find the ones that do not (FAILED). Counts and locations only (contract §6): never a
value. Never writes, never runs DDL (CONFLICTs recorded by runs are read from ``pinrotate.conflicts``
when it exists: ``conflicts.py``).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
import sqlalchemy as sa
from psycopg import sql

from . import scheme_sql
from .config import Settings, TargetSettings
from .conflicts import StateError, last_conflicts
from .db import describe_db_error, raw_connection
from .engines.postgresql import stream as pg_stream
from .errors import ConfigError, DatabaseError, TargetBlocked
from .keyring import Keyring
from .schemes.base import CATEGORIES, LEGACY_KEY, InventoryFacts, Scheme, ValueClass
from .schemes.registry import build_scheme
from .scope import exclusion_rule, scope_condition
from .targets import Column, ResolvedTarget, resolve_target


class DeepPassProgress(Protocol):
    """Who is told how far a value-by-value pass has got (the CLI's display on a terminal)."""

    def start(self, target: str, rows: int) -> None: ...

    def advance(self, target: str, rows: int) -> None: ...


# Set by a caller that shows progress (the gate's deep pass on a terminal); None: nobody is told,
# and nothing is counted for it.
DEEP_PASS_PROGRESS: contextvars.ContextVar[DeepPassProgress | None] = contextvars.ContextVar(
    "pinrotate_deep_pass_progress", default=None)


@dataclass
class TargetInventory:
    target: str
    format: str
    total: int = 0
    by_key: dict[str, int] = field(default_factory=dict)  # in-scope rows/values per key
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    excluded_by_key: dict[str, int] = field(default_factory=dict)  # out of scope, still on a key
    # The same, split by the rule that excluded them (scope.EXCLUSION_RULES): rule -> key -> n.
    excluded_by_rule: dict[str, dict[str, int]] = field(default_factory=dict)
    failed_by_key: dict[str, int] = field(default_factory=dict)
    blocked_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # scheme facts (e.g. transit versions), tenants

    def add(self, category: str, n: int = 1) -> None:
        self.counts[category] += n

    def count(self, value: ValueClass, excluded_by: str | None, n: int = 1) -> None:
        """Count ``n`` values; ``excluded_by``: the scope rule that excludes them, None when in scope."""
        self.total += n
        if excluded_by is not None:
            self.add("EXCLUDED", n)
            if value.key is not None:
                _bump(self.excluded_by_key, value.key, n)
                _bump(self.excluded_by_rule.setdefault(excluded_by, {}), value.key, n)
            return
        self.add(value.category, n)
        if value.key is not None:
            _bump(self.by_key, value.key, n)

    def block(self, reason: str) -> None:
        self.add("BLOCKED")
        self.blocked_reason = self.blocked_reason or reason

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


def _bump(counter: dict[str, int], key: str, n: int = 1) -> None:
    counter[key] = counter.get(key, 0) + n


def blocked_inventory(t: TargetSettings, reason: str) -> TargetInventory:
    inv = TargetInventory(t.name, t.format)
    inv.block(reason)
    return inv


def inventory_target(conn: psycopg.Connection[Any], scheme: Scheme, *, deep: bool = False,
                     tenant: str | None = None) -> TargetInventory:
    """Counts per category and key of one target (see the module docstring)."""
    target = scheme.target
    t = target.settings
    inv = TargetInventory(t.name, t.format)
    scope = scope_condition(t, tenant, "t")
    rule = exclusion_rule(t, tenant, "t")  # NULL exactly where `scope` holds
    keys_sql = scheme_sql.value_keys(scheme, "t")
    if keys_sql is not None:
        per_value = sql.SQL(", ").join(sql.SQL("({}, {})").format(k, p) for k, p in keys_sql)
        rows = conn.execute(sql.SQL(
            "SELECT v.pinrotate_key, {rule}, count(*) FROM {rel} AS t "
            "CROSS JOIN LATERAL (VALUES {per_value}) AS v(pinrotate_key, pinrotate_present) "
            "WHERE v.pinrotate_present GROUP BY 1, 2").format(rule=rule, rel=target.relation, per_value=per_value)
        ).fetchall()
        for key, excluded_by, n in rows:
            inv.count(scheme.classify_key(key), excluded_by, int(n))
        unknown = unversioned_excluded(conn, scheme, rule, keys_sql)
        if unknown:
            inv.counts["EXCLUDED"] -= unknown
            inv.add("UNKNOWN", unknown)
    if keys_sql is None or deep:
        # Value by value: every row when the database could not count, else only the in-scope rows.
        where = sql.SQL("true") if keys_sql is None else scope
        query = sql.SQL("SELECT {rule}, {cols} FROM {rel} AS t WHERE {where}").format(
            rule=rule, cols=sql.SQL(", ").join(scheme_sql.read_list(scheme, "t")), rel=target.relation, where=where)
        told = DEEP_PASS_PROGRESS.get() if deep else None
        if told is not None:  # the rows the pass will read, counted only for someone who shows them
            counted = conn.execute(sql.SQL("SELECT count(*) FROM {rel} AS t WHERE {where}").format(
                rel=target.relation, where=where)).fetchone()
            told.start(t.name, int(counted[0]) if counted else 0)
        for row in pg_stream.stream(conn, query, "pinrotate_inventory",
                                    None if told is None else functools.partial(told.advance, t.name)):
            excluded_by = row[0]
            for value, failed in scheme.inspect(row[1:], deep and excluded_by is None):
                if keys_sql is None:
                    inv.count(value, excluded_by)
                if failed:
                    inv.add("FAILED")
                    _bump(inv.failed_by_key, value.key or LEGACY_KEY)
    if isinstance(scheme, InventoryFacts):
        inv.extra.update(scheme.inventory_facts())
        for fact, condition in scheme_sql.counted_facts(scheme, "t").items():
            row = conn.execute(sql.SQL("SELECT count(*) FROM {rel} AS t WHERE {scope} AND {condition}").format(
                rel=target.relation, scope=scope, condition=condition)).fetchone()
            inv.extra[fact] = int(row[0]) if row else 0
    return conclude_target(inv, scheme, lambda: last_conflicts(conn, t.name, tenant=tenant),
                           lambda: capacity_blocker(conn, scheme, tenant))


def conclude_target(inv: TargetInventory, scheme: Scheme, conflicts: Callable[[], int],
                    capacity: Callable[[], str | None]) -> TargetInventory:
    """The end of a target's inventory on either engine: a ``cas`` target's CONFLICTs as the last
    runs recorded them (unreadable: BLOCKED, fail closed, for conflicts we cannot read might
    exist), then room for the new ciphertexts (a ``varchar(n)`` too narrow: BLOCKED)."""
    if scheme.guard == "cas":
        try:
            inv.counts["CONFLICT"] = conflicts()
        except StateError as e:
            inv.block(str(e))
            return inv
    reason = capacity()
    if reason is not None:
        inv.block(reason)
    return inv


def capacity_blocker(conn: psycopg.Connection[Any], scheme: Scheme, tenant: str | None = None) -> str | None:
    """Why the target is BLOCKED for lack of room (a ``varchar(n)`` too narrow), or None
    (``capacity_reason``, reading PostgreSQL)."""
    target = scheme.target

    def longer_than(column: Column, shortest: int) -> Iterable[Any]:
        query = sql.SQL("SELECT {c} FROM {rel} WHERE {scope} AND {c} IS NOT NULL AND char_length({c}) > %s").format(
            c=sql.Identifier(column.name), rel=target.relation, scope=scope_condition(target.settings, tenant))
        return (stored for (stored,) in conn.execute(query, [shortest]))

    return capacity_reason(scheme, longer_than)


def capacity_reason(scheme: Scheme, longer_than: Callable[[Column, int], Iterable[Any]]) -> str | None:
    """The capacity rule on either engine. For each column with a declared length: the longest
    in-scope value once rewritten under the current key, against that length. Only values long
    enough to possibly overflow are read (``longer_than(column, n)``: the in-scope stored values of
    more than ``n`` characters)."""
    for column in scheme.target.columns:
        limit = column.char_length
        growth = scheme.growth(column)
        if limit is None or growth <= 0:
            continue  # text, json, bytea: no declared length; or a scheme whose values never grow
        worst = max((scheme.length_after(column, stored) or 0 for stored in longer_than(column, limit - growth)),
                    default=0)
        if worst > limit:
            return (f"column {column.name} is {column.sql_type}, too narrow: re-encrypted under key "
                    f"{scheme.current_key} its values need up to {worst} characters "
                    "(widen it; pinrotate never changes the application's schema)")
    return None


def take_inventory(engine: sa.Engine, settings: Settings, keyring: Keyring, *, deep: bool = False,
                   tenant: str | None = None, targets: Sequence[TargetSettings] | None = None,
                   provider: object = None) -> Inventory:
    with raw_connection(engine) as conn:
        return inventory_on(conn, settings, keyring, deep=deep, tenant=tenant, targets=targets, provider=provider)


# Before a target is read: None to go on, else why it cannot be read as planned (it is BLOCKED).
HoldTarget = Callable[[psycopg.Connection[Any], ResolvedTarget], "str | None"]


def bind_for_inventory(resolve: Callable[[TargetSettings], ResolvedTarget], t: TargetSettings, keyring: Keyring,
                       settings: Settings, provider: object) -> tuple[ResolvedTarget, Scheme] | TargetInventory:
    """A target resolved (by the engine's ``resolve``) and bound to its scheme, or, where it is refused,
    its BLOCKED inventory: one rule for every engine."""
    try:
        resolved = resolve(t)
        return resolved, build_scheme(resolved, keyring, settings.keys, provider)
    except TargetBlocked as e:
        return blocked_inventory(t, e.reason)
    except ConfigError as e:
        return blocked_inventory(t, str(e))


def inventory_on(conn: psycopg.Connection[Any], settings: Settings, keyring: Keyring, *, deep: bool = False,
                 tenant: str | None = None, targets: Sequence[TargetSettings] | None = None,
                 provider: object = None, hold: HoldTarget | None = None) -> Inventory:
    """The inventory on ``conn`` (the gate: inside its one snapshot, each target held by ``hold`` first)."""
    chosen = list(settings.targets if targets is None else targets)
    result = Inventory(keyring.current, {}, deep=deep, tenant=tenant)
    for t in chosen:
        bound = bind_for_inventory(lambda t: resolve_target(conn, t, writing=False), t, keyring, settings, provider)
        if isinstance(bound, TargetInventory):
            result.targets[t.name] = bound
            continue
        resolved, scheme = bound
        try:
            held = hold(conn, resolved) if hold is not None else None
            if held is not None:
                result.targets[t.name] = blocked_inventory(t, held)
                continue
            result.targets[t.name] = inventory_target(conn, scheme, deep=deep, tenant=tenant)
            if t.tenant:
                result.targets[t.name].extra["tenants"] = tenants_in_scope(conn, resolved, tenant)
        except psycopg.Error as e:
            raise DatabaseError(f"inventory of target {t.name} failed ({describe_db_error(e)})") from None
    return result


def unversioned_excluded(conn: psycopg.Connection[Any], scheme: Scheme, rule: sql.Composable,
                         keys_sql: list[tuple[sql.Composable, sql.Composable]]) -> int:
    """Values of out-of-scope rows whose key is unknown (NULL) while a cipher column of the row holds a
    value: what they are under cannot be told, so they are UNKNOWN whatever their scope (a
    soft-deleted row too). One count per value, as the main count counts them."""
    target = scheme.target
    unnamed = sql.SQL(" + ").join(sql.SQL("(CASE WHEN {} AND {} IS NULL THEN 1 ELSE 0 END)").format(p, k)
                                  for k, p in keys_sql)
    held = sql.SQL(" OR ").join(sql.SQL("{} IS NOT NULL").format(sql.Identifier("t", c.name))
                                for c in target.columns)
    row = conn.execute(sql.SQL("SELECT COALESCE(sum({unnamed}), 0) FROM {rel} AS t WHERE {rule} IS NOT NULL AND ({held})"
                               ).format(rel=target.relation, rule=rule, unnamed=unnamed, held=held)).fetchone()
    return int(row[0]) if row else 0


def tenants_in_scope(conn: psycopg.Connection[Any], target: ResolvedTarget, tenant: str | None) -> list[str]:
    """The tenants a target's counts cover (identifiers, for the gate report's tenant list)."""
    if tenant is not None:
        return [tenant]
    column = sql.Identifier(target.settings.tenant or "")
    query = sql.SQL("SELECT DISTINCT {col}::text FROM {rel} WHERE {col} IS NOT NULL ORDER BY 1").format(
        col=column, rel=target.relation)
    return [str(row[0]) for row in conn.execute(query).fetchall()]
