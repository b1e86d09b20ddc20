"""THE scope rule: which rows a run, an inventory or a gate may read as "in scope".

One predicate, composed the same way into every statement of every scheme (select, count, update
guard, inventory), on both engines: every ``require_not_null`` column set, the row not
soft-deleted, and with ``--tenant T`` only T's rows, compared byte for byte. It has no parameters
(the tenant is inlined, as hex when it holds a quote, a backslash or a '%'), so it fits statements
with and without bound parameters alike. ``scope_text`` composes it of an engine's SQL pieces. Out-of-scope rows are EXCLUDED: never
read for rewriting, never written; the inventory names the rule that excluded each
(``exclusion_rule``), and the gate counts them by rule.

Soft delete: a row is deleted when its soft-delete column is NOT NULL and not false: boolean true,
a number other than 0, any date or timestamp, text other than '', '0', 'false', 'f', 'n', 'no',
'off' (case and surrounding blanks ignored). A NULL tenant is never in scope of a tenant run (a run
without ``--tenant`` takes it).
"""

from __future__ import annotations

from collections.abc import Sequence

from psycopg import sql

from . import scope_text
from .config import TargetSettings
from .engines.postgresql.operations import OPERATIONS as PG
from .engines.postgresql.operations import composable as _composable
from .errors import ConfigError

# THE rule is composed once, of the engine's pieces (``scope_text``); here it is PostgreSQL's, as
# psycopg Composables for the statements that compose it (drain, inventory, fpc1 pre-check).
EXCLUSION_RULES = scope_text.EXCLUSION_RULES


def _col(name: str, alias: str | None) -> sql.Identifier:
    return sql.Identifier(alias, name) if alias else sql.Identifier(name)


def live_condition(t: TargetSettings, alias: str | None = None) -> sql.Composable:
    """True for rows that are not soft-deleted."""
    return _composable(scope_text.live_condition(t, PG, alias))


def scope_condition(t: TargetSettings, tenant: str | None, alias: str | None = None) -> sql.Composable:
    """True exactly for the rows in scope (NULL counts as out of scope)."""
    return _composable(scope_text.scope_condition(t, tenant, PG, alias))


def exclusion_rule(t: TargetSettings, tenant: str | None, alias: str | None = None) -> sql.Composable:
    """The rule that puts a row out of scope, as text, NULL for a row in scope: NULL exactly where
    ``scope_condition`` is true (same conditions, a NULL again counting as out of scope).

    A row out of scope for several rules is named by the first of ``EXCLUSION_RULES``, so that
    ``tenant`` names only rows that an unfiltered run would take.
    """
    return _composable(scope_text.exclusion_rule(t, tenant, PG, alias))


def tenant_text(t: TargetSettings, alias: str | None = None) -> sql.Composable:
    """The row's tenant as text (NULL for targets without a tenant column)."""
    return sql.SQL("{}::text").format(_col(t.tenant, alias)) if t.tenant else sql.SQL("NULL::text")


def check_tenant_scope(targets: Sequence[TargetSettings], tenant: str | None) -> None:
    """``--tenant`` must scope every target it is applied to: silently ignoring it would count or
    migrate other tenants' rows."""
    if tenant is not None and not all(t.tenant for t in targets):
        missing = ", ".join(t.name for t in targets if not t.tenant)
        raise ConfigError(f"--tenant: targets without a tenant column cannot be scoped: {missing}")
