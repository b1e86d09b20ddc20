"""Inventory of ``fpc1`` targets, and what the fpc1 drain shares with it: scope, value classes, capacity.

Counts VALUES (a row with two encrypted fields counts twice) by category and key id; a column too
narrow for the new ciphertexts makes the target BLOCKED. Read-only: never writes, never runs DDL,
and nothing here returns, logs or raises with a value, a plaintext or a key.

Scope rules (also used by the drain):
- ``tenant``: with ``--tenant T`` only rows whose tenant column, as text, equals T are in scope
  (a NULL tenant is never in scope of a tenant run).
- ``soft_delete``: a row is deleted, hence out of scope, when its soft-delete column is NOT NULL
  and not false: boolean true, a number other than 0, any date or timestamp, text other than
  '', '0', 'false', 'f', 'n', 'no', 'off' (case and surrounding blanks ignored).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg import sql

from .config import KeysSettings, TargetSettings
from .errors import CiphertextInvalid, KeyUnavailable
from .formats.fpc1 import ALGORITHMS, PREFIX, Fpc1CipherSet, classify, json_values_in
from .formats.legacy import LegacyFormat, check_legacy_format, decode_base64_strict
from .inventory import TargetInventory, register_format
from .keyring import Keyring
from .state import StateError, database_identity, last_conflicts
from .targets import Column, ResolvedTarget

LEGACY_KEY: Final = "legacy"
FETCH_ROWS: Final = 5000

# "FPC1:" + algorithm + ":" ... ":" around the key id; both algorithm names have the same length.
assert len({len(a) for a in ALGORITHMS}) == 1
FPC1_OVERHEAD: Final = len(PREFIX) + 1 + len(ALGORITHMS[0]) + 1 + 1
NONCE_AND_TAG: Final = 28
# The most a value can grow on migration, beyond the new prefix: an aes-ecb-b64 legacy value
# (payload up to 27 bytes longer, i.e. 36 more base64 characters). Used to pre-filter in SQL.
MAX_PAYLOAD_GROWTH: Final = 36


# --- scope --------------------------------------------------------------------------------------


def _col(name: str, alias: str | None) -> sql.Identifier:
    return sql.Identifier(alias, name) if alias else sql.Identifier(name)


def live_condition(t: TargetSettings, alias: str | None = None) -> sql.Composable:
    """True for rows that are not soft-deleted (see the module docstring for the rule)."""
    if not t.soft_delete:
        return sql.SQL("true")
    text = sql.SQL("btrim({}::text)").format(_col(t.soft_delete, alias))
    return sql.SQL(
        "({sd} IS NULL OR lower({text}) IN ('', '0', 'false', 'f', 'n', 'no', 'off') OR {text} ~ '^[+-]?0+(\\.0+)?$')"
    ).format(sd=_col(t.soft_delete, alias), text=text)


def scope_condition(t: TargetSettings, tenant: str | None, alias: str | None = None) -> tuple[sql.Composable, list[Any]]:
    """(condition, parameters) selecting the rows a run or an inventory may read or change."""
    conds: list[sql.Composable] = [live_condition(t, alias)]
    params: list[Any] = []
    if tenant is not None:
        if not t.tenant:
            raise ValueError(f"target {t.name} has no tenant column")
        conds.append(sql.SQL("{}::text = %s").format(_col(t.tenant, alias)))
        params.append(tenant)
    return sql.SQL("COALESCE(({}), false)").format(sql.SQL(" AND ").join(conds)), params


def column_as_text(column: Column, alias: str | None = None) -> sql.Composable:
    """The column as text: json/jsonb are read as their text, which the JSON rewrite works on."""
    ident = _col(column.name, alias)
    if column.type_name in ("json", "jsonb"):
        return sql.SQL("{}::text").format(ident)
    return ident


# --- values -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueField:
    """Where one encrypted value lives: a column, or a JSON path inside a column."""

    column: str
    path: str | None = None

    @property
    def label(self) -> str:
        return self.column if self.path is None else f"{self.column}[{self.path}]"


@dataclass(frozen=True)
class ValueClass:
    """Category of one value and the key it names (a key id, ``legacy``, or None when UNKNOWN)."""

    category: str  # ACTIVE | HISTORICAL | LEGACY | UNKNOWN | UNKNOWN_KEY
    key: str | None = None


UNKNOWN_VALUE: Final = ValueClass("UNKNOWN")
STALE: Final = frozenset({"HISTORICAL", "LEGACY", "UNKNOWN_KEY"})


def classify_value(stored: str, keyring: Keyring, legacy_format: LegacyFormat) -> ValueClass:
    """The inventory category of a stored string, without decrypting it."""
    found = classify(stored, legacy_format=legacy_format)
    if found.kind == "fpc1":
        assert found.key_id is not None
        if found.key_id == keyring.current:
            return ValueClass("ACTIVE", found.key_id)
        if found.key_id in keyring.keys:
            return ValueClass("HISTORICAL", found.key_id)
        return ValueClass("UNKNOWN_KEY", found.key_id)
    if found.kind == "legacy-candidate":
        return ValueClass("LEGACY", LEGACY_KEY)
    return UNKNOWN_VALUE


def values_of_column(column: str, paths: Sequence[str], text: str | None) -> list[tuple[ValueField, str | None]]:
    """The encrypted values of one column of one row; ``None`` marks a value that cannot be read.

    A plain column is one value (NULL: none). A ``json_paths`` column holds one value per path
    (absent or null paths: none); a document that is not JSON is one unreadable value, a path
    holding a non-string is an unreadable value at that path.
    """
    if text is None:
        return []
    if not paths:
        return [(ValueField(column), text)]
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return [(ValueField(column), None)]
    out: list[tuple[ValueField, str | None]] = []
    for path in paths:
        try:
            found = json_values_in(document, [path])
        except CiphertextInvalid:
            out.append((ValueField(column, path), None))
            continue
        if path in found:
            out.append((ValueField(column, path), found[path]))
    return out


def fpc1_prefix_length(active_key: str) -> int:
    return FPC1_OVERHEAD + len(active_key)


def length_after(stored: str, value: ValueClass, active_key: str, legacy_format: LegacyFormat) -> int | None:
    """Characters the value will have once migrated to ``active_key``; None if it is never rewritten.

    Known from the stored form alone: GCM keeps the payload length (plaintext + 28 bytes); an
    aes-ecb-b64 value holds a padded plaintext of at most payload - 1 bytes (bound taken).
    """
    if value.category == "ACTIVE":
        return len(stored)
    prefix = fpc1_prefix_length(active_key)
    if value.category in ("HISTORICAL", "UNKNOWN_KEY"):
        return prefix + len(stored.split(":", 3)[3])
    if value.category == "LEGACY":
        if legacy_format == "aesgcm-b64":
            return prefix + len(stored)
        padded = len(decode_base64_strict(stored))
        return prefix + 4 * math.ceil((padded - 1 + NONCE_AND_TAG) / 3)
    return None


# --- capacity -----------------------------------------------------------------------------------


def capacity_blocker(conn: psycopg.Connection[Any], target: ResolvedTarget, active_key: str, *,
                     legacy_format: str, tenant: str | None = None) -> str | None:
    """Why the target is BLOCKED for lack of room (a varchar(n) too narrow), or None.

    For each column with a declared length: the longest in-scope value after migration to
    ``active_key`` against that length. Only values long enough to possibly overflow are read.
    """
    t = target.settings
    fmt = check_legacy_format(legacy_format)
    scope, scope_params = scope_condition(t, tenant)
    prefix = fpc1_prefix_length(active_key)
    for column in target.columns:
        limit = column.char_length
        if limit is None:
            continue  # text, json, jsonb: no declared length
        paths = t.json_paths.get(column.name, ())
        threshold = limit - max(len(paths), 1) * (prefix + MAX_PAYLOAD_GROWTH)
        query = sql.SQL("SELECT {c} FROM {rel} WHERE {scope} AND {c} IS NOT NULL AND char_length({c}) > %s").format(
            c=sql.Identifier(column.name), rel=target.relation, scope=scope)
        worst = 0
        for (text,) in conn.execute(query, [*scope_params, threshold]):
            worst = max(worst, _document_length_after(text, column.name, paths, active_key, fmt))
        if worst > limit:
            return (f"column {column.name} is {column.sql_type}, too narrow: re-encrypted under key {active_key} "
                    f"its values need up to {worst} characters (widen it; pinrotate never runs DDL)")
    return None


def _document_length_after(text: str, column: str, paths: Sequence[str], active_key: str,
                           legacy_format: LegacyFormat) -> int:
    """Length of a column value after migration (an upper bound for JSON documents)."""
    # The keyring is not needed to size a value: any key id but the active one is rewritten.
    growth = 0
    for _, stored in values_of_column(column, paths, text):
        if stored is None:
            continue
        value = _shape(stored, active_key, legacy_format)
        after = length_after(stored, value, active_key, legacy_format)
        if after is not None:
            growth += after - len(stored)
    return len(text) + growth


def _shape(stored: str, active_key: str, legacy_format: LegacyFormat) -> ValueClass:
    found = classify(stored, legacy_format=legacy_format)
    if found.kind == "fpc1":
        return ValueClass("ACTIVE" if found.key_id == active_key else "HISTORICAL", found.key_id)
    if found.kind == "legacy-candidate":
        return ValueClass("LEGACY", LEGACY_KEY)
    return UNKNOWN_VALUE


# --- the inventory ------------------------------------------------------------------------------


def _bump(counter: dict[str, int], key: str) -> None:
    counter[key] = counter.get(key, 0) + 1


def iter_rows(conn: psycopg.Connection[Any], target: ResolvedTarget, tenant: str | None,
              name: str) -> Iterator[tuple[Any, ...]]:
    """Every row as ``(in_scope, *columns as text)``, streamed by a server-side cursor."""
    scope, params = scope_condition(target.settings, tenant)
    query = sql.SQL("SELECT {scope}, {cols} FROM {rel}").format(
        scope=scope, cols=sql.SQL(", ").join(column_as_text(c) for c in target.columns), rel=target.relation)
    with conn.transaction(), conn.cursor(name=name) as cur:
        cur.itersize = FETCH_ROWS
        cur.execute(query, params)
        yield from cur


def inventory_fpc1(conn: psycopg.Connection[Any], target: ResolvedTarget, keyring: Keyring, deep: bool,
                   tenant: str | None, keys: KeysSettings) -> TargetInventory:
    """Counts per value: ACTIVE, HISTORICAL, LEGACY, UNKNOWN, UNKNOWN_KEY, EXCLUDED (+ FAILED with
    ``deep``), ``by_key`` per key id and ``legacy``; CONFLICT from the last runs; BLOCKED for lack of room."""
    t = target.settings
    legacy_format = check_legacy_format(keys.legacy_format)
    inv = TargetInventory(t.name, t.format)
    excluded_legacy = 0
    # Deep reading decrypts legacy values whenever the keyring has the legacy key, whatever
    # legacy_read_enabled says: counting is not migrating.
    ciphers = Fpc1CipherSet(keyring, legacy_format=legacy_format, legacy_read_enabled=True) if deep else None
    for row in iter_rows(conn, target, tenant, "pinrotate_fpc1_inventory"):
        in_scope = bool(row[0])
        for column, text in zip(target.columns, row[1:]):
            for _field, stored in values_of_column(column.name, t.json_paths.get(column.name, ()), text):
                inv.total += 1
                value = UNKNOWN_VALUE if stored is None else classify_value(stored, keyring, legacy_format)
                if not in_scope:
                    inv.add("EXCLUDED")
                    if value.key == LEGACY_KEY:
                        excluded_legacy += 1
                    elif value.key is not None:
                        _bump(inv.excluded_by_key, value.key)
                    continue
                inv.add(value.category)
                if value.key is not None:
                    _bump(inv.by_key, value.key)
                if ciphers is not None and stored is not None and value.category in ("ACTIVE", "HISTORICAL", "LEGACY"):
                    if value.category == "LEGACY" and keyring.legacy is None:
                        continue  # nothing to try it with; it stays LEGACY
                    try:
                        ciphers.decrypt(stored)
                    except CiphertextInvalid:
                        inv.add("FAILED")
                        _bump(inv.failed_by_key, value.key or LEGACY_KEY)
                    except KeyUnavailable:
                        pass  # cannot happen for the categories tried; UNKNOWN_KEY is counted already
    inv.extra["excluded_legacy"] = excluded_legacy
    try:
        inv.counts["CONFLICT"] = last_conflicts(database_identity(conn), t.name, tenant=tenant)
    except StateError as e:
        # Fail closed: conflicts we cannot read might exist.
        inv.add("BLOCKED")
        inv.blocked_reason = str(e)
        return inv
    reason = capacity_blocker(conn, target, keyring.current, legacy_format=legacy_format, tenant=tenant)
    if reason is not None:
        inv.add("BLOCKED")
        inv.blocked_reason = reason
    return inv


# Registered without the decorator so that the name keeps its full signature (``keys``).
register_format("fpc1")(inventory_fpc1)
