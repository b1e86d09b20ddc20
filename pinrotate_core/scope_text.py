"""THE scope rule (see ``scope``) composed once, from an engine's SQL pieces
(``engines.base.operations``): MySQL / MariaDB statements use the text as it is, PostgreSQL's
through ``scope``'s psycopg wrappers. No parameters: the tenant is inlined by ``text_literal``, so
the text fits statements with and without bound parameters alike.
"""

from __future__ import annotations

from .config import TargetSettings
from .engines.base.operations import Operations
from .errors import ConfigError

EXCLUSION_RULES = ("require_not_null", "soft_delete", "tenant")
FALSE_WORDS = ("", "0", "false", "f", "n", "no", "off")
ZERO_PATTERN = "^[+-]?0+([.]0+)?$"  # a number written as zero: 0, -00, 0.000


def live_condition(t: TargetSettings, ops: Operations, alias: str | None = None) -> str:
    """True for rows that are not soft-deleted (see ``scope`` for the rule)."""
    if not t.soft_delete:
        return "(1 = 1)"
    col = ops.column(t.soft_delete, alias)
    text = f"TRIM({ops.text_of(col)})"
    words = ", ".join(ops.text_literal(w) for w in FALSE_WORDS)
    return (f"({col} IS NULL OR LOWER({text}) IN ({words}) OR "
            f"{ops.regex_match(text, ZERO_PATTERN)})")


def rule_conditions(t: TargetSettings, tenant: str | None, ops: Operations,
                    alias: str | None = None) -> list[tuple[str, str]]:
    """(rule, condition) pairs in ``EXCLUSION_RULES`` order: in scope when every one holds."""
    conds = [("require_not_null", f"{ops.column(c, alias)} IS NOT NULL") for c in t.require_not_null]
    conds.append(("soft_delete", live_condition(t, ops, alias)))
    if tenant is not None:
        if not t.tenant:
            raise ConfigError(f"--tenant: target {t.name} has no tenant column")
        conds.append(("tenant", ops.exact_text_equal(ops.text_of(ops.column(t.tenant, alias)),
                                                     ops.text_literal(tenant))))
    return conds


def scope_condition(t: TargetSettings, tenant: str | None, ops: Operations, alias: str | None = None) -> str:
    """True exactly for the rows in scope (NULL counts as out of scope)."""
    return f"COALESCE(({' AND '.join(c for _, c in rule_conditions(t, tenant, ops, alias))}), 1 = 0)"


def exclusion_rule(t: TargetSettings, tenant: str | None, ops: Operations, alias: str | None = None) -> str:
    """The first rule that puts a row out of scope, NULL for a row in scope."""
    whens = " ".join(f"WHEN NOT COALESCE(({c}), 1 = 0) THEN {ops.text_literal(rule)}"
                     for rule, c in rule_conditions(t, tenant, ops, alias))
    return f"(CASE {whens} ELSE NULL END)"
