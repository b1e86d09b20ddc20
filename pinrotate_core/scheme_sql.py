"""A scheme's SQL (``schemes.base.Scheme``: composed once, of an engine's pieces) as psycopg
Composables for PostgreSQL's statements (drain, inventory, fpc1 pre-pass, verify), as ``scope.py``
is THE scope rule's. MySQL's statements take the same methods' text as it is."""

from __future__ import annotations

from psycopg import sql

from .engines.postgresql.operations import OPERATIONS as PG
from .engines.postgresql.operations import composable
from .schemes.base import InventoryFacts, Scheme


def stale_condition(scheme: Scheme, alias: str | None = None) -> sql.Composable:
    return composable(scheme.stale_condition(PG, alias))


def read_list(scheme: Scheme, alias: str | None = None) -> list[sql.Composable]:
    return [composable(item) for item in scheme.read_list(PG, alias)]


def value_keys(scheme: Scheme, alias: str) -> list[tuple[sql.Composable, sql.Composable]] | None:
    keys = scheme.value_keys_sql(PG, alias)
    return None if keys is None else [(composable(key), composable(present)) for key, present in keys]


def counted_facts(scheme: InventoryFacts, alias: str) -> dict[str, sql.Composable]:
    return {name: composable(condition) for name, condition in scheme.counted_facts(PG, alias).items()}
