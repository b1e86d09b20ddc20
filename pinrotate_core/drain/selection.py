"""The rows one drain may touch, as SQL: stale by its scheme, admitted by THE scope rule
(``scope.py``), within an id range. Composed once per drain; every guard, count and plan
uses these pieces, never a copy of them. Statements only: nothing is executed here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg import sql

from ..schemes.base import Scheme
from ..scope import scope_condition


class Selection:
    def __init__(self, scheme: Scheme, tenant: str | None) -> None:
        self.scheme = scheme
        self.target = scheme.target
        settings = self.target.settings
        self.id = sql.Identifier(settings.id)
        # THE scope rule, composed once: bare for reads and counts, aliased "t" for update guards.
        self.scope = scope_condition(settings, tenant)
        self.scope_t = scope_condition(settings, tenant, "t")
        self.where = sql.SQL("{} AND {}").format(scheme.stale_condition(), self.scope)
        self.where_t = sql.SQL("{} AND {}").format(scheme.stale_condition("t"), self.scope_t)

    def range(self, lo: Any, hi: Any) -> tuple[list[sql.Composable], list[Any]]:
        """Conditions (and their parameters) for ids in ``(lo, hi]``; None: an open end."""
        conds: list[sql.Composable] = []
        params: list[Any] = []
        if lo is not None:
            conds.append(sql.SQL("{} > %s").format(self.id))
            params.append(lo)
        if hi is not None:
            conds.append(sql.SQL("{} <= %s").format(self.id))
            params.append(hi)
        return conds, params

    def stale_in(self, conds: list[sql.Composable]) -> sql.Composable:
        """Stale, in scope, and ``conds`` (an id range)."""
        return sql.SQL(" AND ").join([self.where, *conds])

    def next_batch(self, lo: Any, hi: Any, size: int,
                   extra: Sequence[sql.Composable] = ()) -> tuple[sql.Composed, list[Any]]:
        """The next ``size`` stale rows after ``lo`` (up to ``hi``) in id order, without row locks;
        ``extra`` columns after the scheme's."""
        conds, params = self.range(lo, hi)
        query = sql.SQL("SELECT {id}, {cols} FROM {rel} WHERE {where} ORDER BY {id} LIMIT %s").format(
            id=self.id, cols=sql.SQL(", ").join([*self.scheme.read_list(), *extra]), rel=self.target.relation,
            where=self.stale_in(conds))
        return query, [*params, size]
