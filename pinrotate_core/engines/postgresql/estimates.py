"""A shard plan's reads on PostgreSQL: the planner's estimate of a table's rows
(``pg_class.reltuples``) and the quantiles of the id over the stale rows, from every stale id or
from a page sample (``TABLESAMPLE SYSTEM``). (MySQL: ``information_schema.TABLES.TABLE_ROWS``, no
TABLESAMPLE: ``commands/mysql/selection.py`` samples by id.) How many ranges, when to sample and what a
sample stands for are the caller's (``drain/shards.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

_RELTUPLES_SQL = "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass"


def estimated_rows(conn: psycopg.Connection[Any], relation: sql.Composable) -> int:
    """The planner's estimate of the table's rows (pg_class.reltuples; 0 when never analyzed)."""
    row = conn.execute(_RELTUPLES_SQL, [relation.as_string(conn)]).fetchone()
    return max(0, int(row[0])) if row and row[0] is not None else 0


def id_quantiles(id_column: sql.Composable, relation: sql.Composable, where: sql.Composable,
                 where_params: Sequence[Any], fractions: Sequence[float],
                 sample_percent: float | None) -> tuple[sql.Composed, list[Any]]:
    """(query, parameters) of the quantiles ``fractions`` of ``id_column`` over the rows of
    ``relation`` meeting ``where`` (of parameters ``where_params``): one row of (the rows meeting
    ``where`` seen, the quantiles in the server's order) over the whole table; with
    ``sample_percent``, over a page sample of that percent of it, plus (third) every row of the
    sampled pages seen."""
    if sample_percent is None:
        query = sql.SQL("SELECT count(*), percentile_disc(%s::float8[]) WITHIN GROUP (ORDER BY {id}) "
                        "FROM {rel} WHERE {where}").format(id=id_column, rel=relation, where=where)
        return query, [fractions, *where_params]
    # every row of the sampled pages is seen: its stale share scales the planner's estimate
    query = sql.SQL(
        "SELECT count(*) FILTER (WHERE s.stale), percentile_disc(%s::float8[]) WITHIN GROUP "
        "(ORDER BY s.pinrotate_id) FILTER (WHERE s.stale), count(*) "
        "FROM (SELECT {id} AS pinrotate_id, ({where}) AS stale FROM {rel} TABLESAMPLE SYSTEM (%s)) AS s"
    ).format(id=id_column, rel=relation, where=where)
    return query, [fractions, *where_params, sample_percent]
