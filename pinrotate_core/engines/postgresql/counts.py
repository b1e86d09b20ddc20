"""A drain's backlog counts on PostgreSQL: rows meeting a condition counted per id range in one
scan (``count(*) FILTER``), with and without some ids (``= ANY``), and the setting that makes a
count over part of the ids walk the primary key. What is counted (stale, in scope, which ranges,
which ids) is the caller's (``drain/counting.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

_SEQSCAN_OFF = "SET LOCAL enable_seqscan = off"


def range_counts(relation: sql.Composable, where: sql.Composable, where_params: Sequence[Any],
                 cuts: Sequence[tuple[Sequence[sql.Composable], Sequence[Any]]]) -> tuple[sql.Composed, list[Any]]:
    """(query, parameters): one row of the rows of ``relation`` meeting ``where`` (of parameters
    ``where_params``) counted within each cut (its conditions and their parameters; no
    conditions: every row), in one scan."""
    filters: list[sql.Composable] = []
    filter_params: list[Any] = []
    for cut, cut_params in cuts:
        filters.append(sql.SQL("count(*) FILTER (WHERE {})").format(sql.SQL(" AND ").join(cut or [sql.SQL("true")])))
        filter_params += cut_params
    query = sql.SQL("SELECT {counts} FROM {rel} WHERE {where}").format(
        counts=sql.SQL(", ").join(filters), rel=relation, where=where)
    return query, [*filter_params, *where_params]


def row_counts(relation: sql.Composable, id_column: sql.Composable, where: sql.Composable,
               where_params: Sequence[Any], exclude: frozenset[str]) -> tuple[sql.Composed, list[Any]]:
    """(query, parameters): one row of the rows of ``relation`` meeting ``where`` (of parameters
    ``where_params``) counted, then (only when ``exclude`` is not empty) those whose
    ``id_column``'s text is not in ``exclude``, in one scan."""
    params = list(where_params)
    unfailed: sql.Composable = sql.SQL("")  # without exclude, the one count serves as both
    if exclude:
        unfailed = sql.SQL(", count(*) FILTER (WHERE NOT ({}::text = ANY(%s)))").format(id_column)
        params.insert(0, list(exclude))
    query = sql.SQL("SELECT count(*){unfailed} FROM {rel} WHERE {where}").format(
        unfailed=unfailed, rel=relation, where=where)
    return query, params


def walk_primary_key(conn: psycopg.Connection[Any]) -> None:
    """In the open transaction: sequential scans off, so that a count over part of the ids walks
    the primary key over that part."""
    conn.execute(_SEQSCAN_OFF)
