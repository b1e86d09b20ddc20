"""A drain's keyset reads on PostgreSQL (MySQL's are ``commands/mysql/selection.py`` over ``Operations``):
conditions joined with AND, the conditions of an id range ``(lo, hi]``, the row comparison that
resumes a pass over a tree of tables after a row, and the statement reading the next batch in id
order. Which rows are stale and in scope, and which columns are read, is the caller's
(``drain/selection.py``). Statements only: nothing is executed here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg import sql


def all_of(conditions: Sequence[sql.Composable]) -> sql.Composed:
    """``conditions`` joined with AND (none parenthesised: each is one already, or a comparison)."""
    return sql.SQL(" AND ").join(conditions)


def id_range(id_column: sql.Composable, lo: Any, hi: Any) -> tuple[list[sql.Composable], list[Any]]:
    """Conditions (and their parameters) for ids in ``(lo, hi]``; None: an open end."""
    conds: list[sql.Composable] = []
    params: list[Any] = []
    if lo is not None:
        conds.append(sql.SQL("{} > %s").format(id_column))
        params.append(lo)
    if hi is not None:
        conds.append(sql.SQL("{} <= %s").format(id_column))
        params.append(hi)
    return conds, params


def after_row(id_column: sql.Composable, then_by: Sequence[sql.Composable], id_value: Any, rest: Sequence[Any],
              types: Sequence[str]) -> tuple[list[sql.Composable], list[Any]]:
    """Conditions (and their parameters) for the rows after the row of id ``id_value`` whose
    ``then_by`` columns (what orders rows of one id) hold ``rest`` (binary values of the SQL types
    ``types``), in the order of the id then ``then_by``."""
    keys = [id_column, *then_by]
    conds: list[sql.Composable] = [sql.SQL("({}) > ({})").format(sql.SQL(", ").join(keys), sql.SQL(", ").join(
        [sql.SQL("%s"), *(sql.SQL("%b::{}").format(sql.Identifier(t)) for t in types)]))]
    # The row comparison gives the index the id's lower bound only: say it plainly.
    conds.append(sql.SQL("{} >= %s").format(id_column))
    return conds, [id_value, *rest, id_value]


def next_batch(relation: sql.Composable, id_column: sql.Composable, columns: Sequence[sql.Composable],
               where: sql.Composable, then_by: Sequence[sql.Composable] = ()) -> sql.Composed:
    """The rows of ``relation`` meeting ``where``: their id and ``columns``, in the order of the id
    (then ``then_by``), without row locks; its last parameter is the batch size (``LIMIT %s``)."""
    return sql.SQL("SELECT {id}, {cols} FROM {rel} WHERE {where} ORDER BY {order} LIMIT %s").format(
        id=id_column, cols=sql.SQL(", ").join(columns), rel=relation, where=where,
        order=sql.SQL(", ").join([id_column, *then_by]))
