"""The rows one drain may touch, as SQL: stale by its scheme, admitted by THE scope rule
(``scope.py``), within an id range. Composed once per drain; every guard, count and plan
uses these pieces, never a copy of them. The keyset statements are the PostgreSQL room's
(``engines/postgresql/selection.py``); nothing is executed here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from .. import scheme_sql
from ..engines.postgresql import selection as pg_selection
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
        self.where = pg_selection.all_of([scheme_sql.stale_condition(scheme), self.scope])
        self.where_t = pg_selection.all_of([scheme_sql.stale_condition(scheme, "t"), self.scope_t])

    def range(self, lo: Any, hi: Any) -> tuple[list[sql.Composable], list[Any]]:
        """Conditions (and their parameters) for ids in ``(lo, hi]``; None: an open end."""
        return pg_selection.id_range(self.id, lo, hi)

    def stale_in(self, conds: list[sql.Composable]) -> sql.Composable:
        """Stale, in scope, and ``conds`` (an id range)."""
        return pg_selection.all_of([self.where, *conds])

    def next_batch(self, lo: Any, hi: Any, size: int, extra: Sequence[sql.Composable] = (),
                   then_by: Sequence[sql.Composable] = ()) -> tuple[sql.Composed, list[Any]]:
        """The next ``size`` stale rows after ``lo`` (up to ``hi``) in id order, without row locks;
        ``extra`` columns after the scheme's. ``then_by``: what orders rows of one id (an
        inheritance tree's ids repeat); ``lo`` is then an id, or a ``Position`` of as many values
        after the id, whose rows of that id are read from after it."""
        if isinstance(lo, Position):
            conds, params = self.range(None, hi)
            after, after_params = pg_selection.after_row(self.id, then_by, lo.id, lo.rest, lo.types)
            conds, params = [*conds, *after], [*params, *after_params]
        else:
            conds, params = self.range(lo, hi)
        query = pg_selection.next_batch(self.target.relation, self.id, [*scheme_sql.read_list(self.scheme), *extra],
                                        self.stale_in(conds), then_by)
        return query, [*params, size]


@dataclass(frozen=True)
class Position:
    """Where a keyset pass over a tree of tables stands: the last row's id and, after it, what
    orders rows of one id (``types``: their SQL types, ``rest``: their binary values)."""

    id: Any
    rest: tuple[Any, ...]
    types: tuple[str, ...]
