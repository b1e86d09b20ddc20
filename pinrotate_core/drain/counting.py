"""Backlog counts of one drain: rows (or values, for schemes that count values) still to move, in
scope, within an id range or cut into ranges. Reads only; it never writes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import psycopg
from psycopg import sql

from .. import scheme_sql
from ..engines.postgresql import counts as pg_counts
from ..schemes.base import Scheme
from .selection import Selection

SCAN_ROWS = 5000


@runtime_checkable
class CountsStaleValues(Protocol):
    """What a scheme whose backlog is counted in values (``counts_values``, e.g. fpc1) adds."""

    def stale_values(self, row: Sequence[Any]) -> int:
        """How many values of a row read with ``read_list`` are stale."""


class BacklogCounter:
    def __init__(self, scheme: Scheme, selection: Selection, id_range: tuple[Any, Any]) -> None:
        self._values: CountsStaleValues | None = None
        if scheme.counts_values:
            if not isinstance(scheme, CountsStaleValues):
                raise TypeError(f"scheme {scheme.name} counts values but cannot count a row's stale values")
            self._values = scheme
        self.scheme = scheme
        self.selection = selection
        self.id_range = id_range

    def count_backlog(self, conn: psycopg.Connection[Any], exclude: frozenset[str] = frozenset(),
                      id_range: tuple[Any, Any] | None = None) -> int:
        """Rows (or values, for value-counting schemes) still to move, in scope."""
        if self._values is None:
            return self._count_rows(conn, exclude, id_range)[0 if not exclude else 1]
        return self._count_values(self._values, conn, exclude, id_range)

    def count_left(self, conn: psycopg.Connection[Any], failed: frozenset[str]) -> tuple[int, int]:
        """The backlog (all of it, and without the rows that failed): one scan for row counts."""
        if self._values is None:
            return self._count_rows(conn, failed)
        return (self._count_values(self._values, conn, frozenset(), None),
                self._count_values(self._values, conn, failed, None))

    def count_ranges(self, conn: psycopg.Connection[Any], bounds: Sequence[Any]) -> list[int]:
        """The backlog of each range that ``bounds`` cut ``id_range`` into; one scan for row counts."""
        lo, hi = self.id_range
        if self._values is not None:
            return [self.count_backlog(conn, id_range=r) for r in zip([lo, *bounds], [*bounds, hi])]
        s = self.selection
        conds, params = s.range(lo, hi)  # the outer ends; each count below cuts between bounds
        query, args = pg_counts.range_counts(s.target.relation, s.stale_in(conds), params,
                                             [s.range(a, b) for a, b in zip([None, *bounds], [*bounds, None])])
        row = conn.execute(query, args).fetchone()
        return [int(n) for n in row] if row else [0] * (len(bounds) + 1)

    def _count_rows(self, conn: psycopg.Connection[Any], exclude: frozenset[str] = frozenset(),
                    id_range: tuple[Any, Any] | None = None) -> tuple[int, int]:
        """Stale rows in scope: (all of them, those whose id is not in ``exclude``), in one scan."""
        s = self.selection
        conds, params = s.range(*(id_range or self.id_range))
        query, args = pg_counts.row_counts(s.target.relation, s.id, s.stale_in(conds), params, exclude)
        with conn.transaction():
            _count_by_primary_key_in_a_range(conn, conds)
            row = conn.execute(query, args).fetchone()
        return (int(row[0]), int(row[-1])) if row else (0, 0)

    def _count_values(self, values: CountsStaleValues, conn: psycopg.Connection[Any], exclude: frozenset[str],
                      id_range: tuple[Any, Any] | None) -> int:
        s = self.selection
        conds, params = s.range(*(id_range or self.id_range))
        query = sql.SQL("SELECT {id}, {cols} FROM {rel} WHERE {where}").format(
            id=s.id, cols=sql.SQL(", ").join(scheme_sql.read_list(self.scheme)), rel=s.target.relation,
            where=s.stale_in(conds))
        stale = 0
        with conn.transaction(), conn.cursor(name="pinrotate_backlog") as cur:
            _count_by_primary_key_in_a_range(conn, conds)
            cur.itersize = SCAN_ROWS
            cur.execute(query, params)
            for row in cur:
                if str(row[0]) not in exclude:
                    stale += values.stale_values(row[1:])
        return stale


def _count_by_primary_key_in_a_range(conn: psycopg.Connection[Any], range_conditions: Sequence[sql.Composable]) -> None:
    """In the open transaction, when the count is over part of the ids (a shard): turn sequential
    scans off, so that the count walks the primary key over that part, never the whole table. The
    planner would scan the whole table for a shard of a quarter or an eighth of the ids, so that N
    shards would each read the whole table; by the index, a shard's count costs in proportion to
    the shard, less than its drain's own reads."""
    if range_conditions:
        pg_counts.walk_primary_key(conn)
