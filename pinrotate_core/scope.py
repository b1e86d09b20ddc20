"""THE scope rule: which rows a run, an inventory or a gate may read as "in scope".

One predicate, composed the same way into every statement of every scheme (select, count, update
guard, inventory): every ``require_not_null`` column set, the row not soft-deleted, and with
``--tenant T`` only T's rows. It has no parameters (the tenant is inlined as a hex literal), so it
fits statements with and without bound parameters alike. Out-of-scope rows are EXCLUDED: never
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

from .config import TargetSettings
from .errors import ConfigError


def _col(name: str, alias: str | None) -> sql.Identifier:
    return sql.Identifier(alias, name) if alias else sql.Identifier(name)


def live_condition(t: TargetSettings, alias: str | None = None) -> sql.Composable:
    """True for rows that are not soft-deleted."""
    if not t.soft_delete:
        return sql.SQL("true")
    text = sql.SQL("btrim({}::text)").format(_col(t.soft_delete, alias))
    return sql.SQL(
        "({sd} IS NULL OR lower({text}) IN ('', '0', 'false', 'f', 'n', 'no', 'off') OR {text} ~ '^[+-]?0+(\\.0+)?$')"
    ).format(sd=_col(t.soft_delete, alias), text=text)


EXCLUSION_RULES = ("require_not_null", "soft_delete", "tenant")


def _rule_conditions(t: TargetSettings, tenant: str | None, alias: str | None) -> list[tuple[str, sql.Composable]]:
    """(rule, condition) pairs, in ``EXCLUSION_RULES`` order: a row is in scope when every condition holds."""
    conds: list[tuple[str, sql.Composable]] = [
        ("require_not_null", sql.SQL("{} IS NOT NULL").format(_col(c, alias))) for c in t.require_not_null]
    conds.append(("soft_delete", live_condition(t, alias)))
    if tenant is not None:
        if not t.tenant:
            raise ConfigError(f"--tenant: target {t.name} has no tenant column")
        # Inlined as hex: a '%' in a plain literal would read as a placeholder where parameters are bound.
        conds.append(("tenant", sql.SQL("{}::text = convert_from(decode({}, 'hex'), 'UTF8')").format(
            _col(t.tenant, alias), sql.Literal(tenant.encode().hex()))))
    return conds


def scope_condition(t: TargetSettings, tenant: str | None, alias: str | None = None) -> sql.Composable:
    """True exactly for the rows in scope (NULL counts as out of scope)."""
    conds = [cond for _, cond in _rule_conditions(t, tenant, alias)]
    return sql.SQL("COALESCE(({}), false)").format(sql.SQL(" AND ").join(conds))


def exclusion_rule(t: TargetSettings, tenant: str | None, alias: str | None = None) -> sql.Composable:
    """The rule that puts a row out of scope, as text, NULL for a row in scope: NULL exactly where
    ``scope_condition`` is true (same conditions, a NULL again counting as out of scope).

    A row out of scope for several rules is named by the first of ``EXCLUSION_RULES``, so that
    ``tenant`` names only rows that an unfiltered run would take.
    """
    whens = [sql.SQL("WHEN NOT COALESCE(({}), false) THEN {}").format(cond, sql.Literal(rule))
             for rule, cond in _rule_conditions(t, tenant, alias)]
    return sql.SQL("(CASE {} ELSE NULL END)::text").format(sql.SQL(" ").join(whens))


def tenant_text(t: TargetSettings, alias: str | None = None) -> sql.Composable:
    """The row's tenant as text (NULL for targets without a tenant column)."""
    return sql.SQL("{}::text").format(_col(t.tenant, alias)) if t.tenant else sql.SQL("NULL::text")


def check_tenant_scope(targets: Sequence[TargetSettings], tenant: str | None) -> None:
    """``--tenant`` must scope every target it is applied to: silently ignoring it would count or
    migrate other tenants' rows."""
    if tenant is not None and not all(t.tenant for t in targets):
        missing = ", ".join(t.name for t in targets if not t.tenant)
        raise ConfigError(f"--tenant: targets without a tenant column cannot be scoped: {missing}")
