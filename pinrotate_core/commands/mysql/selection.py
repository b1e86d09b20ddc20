"""Which rows a MySQL / MariaDB run reads, and how its backlog splits into shards (``.run``'s
selection, as ``drain.selection`` and ``drain.shards`` are on PostgreSQL).

The rows a run may write are in scope and stale by the scheme's own ``stale_condition``, the
same SQL as on PostgreSQL composed of MySQL's pieces (``stale_where``). Batches are keyset
batches in id order, read without locks (``read_batch``); ``fpc1``'s pre-pass reads the stale rows
of the whole target (``stale_rows``). Shards: the backlog is counted exactly in one unbuffered pass in id order (there is
no ``reltuples`` or ``TABLESAMPLE``), keeping the cumulative count at most ``SAMPLE_ROWS`` points;
the bounds are the ids at equal shares of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pymysql
import sqlalchemy as sa

from ...config import TargetSettings
from ...drain.counting import CountsStaleValues
from ...drain.options import DrainOptions
from ...drain.shards import MIN_BATCHES_PER_SHARD, SAMPLE_ROWS, Shard
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql.connect import MySqlConnection
from ...engines.mysql.operations import OPERATIONS as ops
from ...errors import DatabaseError
from ...schemes.base import Scheme
from ...scope_text import scope_condition
from .inventory import stream

ALIAS = "t"


def stale_where(scheme: Scheme, tenant: str | None) -> str:
    """The rows a run may write: in scope and stale by the scheme's ``stale_condition``, the same
    SQL as on PostgreSQL composed of MySQL's pieces (``fpc1``: a pre-filter; the plan decides each value)."""
    return (f"({scope_condition(scheme.target.settings, tenant, ops, ALIAS)}"
            f" AND {scheme.stale_condition(ops, ALIAS)})")


def select_batch(scheme: Scheme, tenant: str | None, lo: Any, hi: Any, size: int | None,
            columns: Sequence[str] | None = None, only: Sequence[Any] | None = None) -> tuple[str, tuple[Any, ...]]:
    """The stale rows in ``(lo, hi]`` in id order (``size`` of them; None: all); with ``only``, among those ids."""
    t = scheme.target.settings
    idcol = ops.column(t.id, ALIAS)
    conds, params = ops.keyset(idcol, lo, hi)
    if only is not None:
        conds, params = [*conds, f"{idcol} IN ({', '.join(['%s'] * len(only))})"], [*params, *only]
    statement = ops.next_batch([idcol, *(scheme.read_list(ops, ALIAS) if columns is None else columns)],
                               ops.relation(t.schema_name, t.table_name, ALIAS), [stale_where(scheme, tenant), *conds],
                               idcol)
    if size is None:
        return statement.removesuffix(" LIMIT %s"), tuple(params)
    return statement, (*params, size)


def read_batch(conn: MySqlConnection, scheme: Scheme, tenant: str | None, lo: Any, hi: Any,
               size: int, only: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    """The next batch of in-scope rows after id ``lo`` (up to ``hi``): ``(id, *read_list)`` each;
    with ``only`` (a sweep), among those ids only."""
    statement, params = select_batch(scheme, tenant, lo, hi, size, only=only)
    with conn.cursor() as cur:
        cur.execute(statement, params)
        return [tuple(r) for r in cur.fetchall()]


def rows_in_scope(conn: MySqlConnection, scheme: Scheme, tenant: str | None,
                  ids: Sequence[Any]) -> dict[Any, tuple[Any, ...]]:
    """The rows of ``ids`` still in scope, stale or not: ``(id, *read_list)`` by id (a row gone or
    out of scope is absent)."""
    if not ids:
        return {}
    t = scheme.target.settings
    idcol = ops.column(t.id, ALIAS)
    statement = (f"SELECT {idcol}, {', '.join(scheme.read_list(ops, ALIAS))}"
                 f" FROM {ops.relation(t.schema_name, t.table_name, ALIAS)}"
                 f" WHERE {idcol} IN ({', '.join(['%s'] * len(ids))}) AND {scope_condition(t, tenant, ops, ALIAS)}")
    with conn.cursor() as cur:
        cur.execute(statement, tuple(ids))
        return {r[0]: tuple(r) for r in cur.fetchall()}


def stale_rows(conn: MySqlConnection, scheme: Scheme, id_range: tuple[Any, Any]) -> Iterator[tuple[Any, ...]]:
    """Every stale row of the whole target, every tenant and every id, in one unbuffered pass:
    ``(id, in id_range, *read_list)`` (the range told by the server: its order is the id's)."""
    t = scheme.target.settings
    idcol = ops.column(t.id, ALIAS)
    conds, params = ops.keyset(idcol, *id_range)
    in_range = " AND ".join(f"({c})" for c in conds) or "TRUE"
    statement = (f"SELECT {idcol}, ({in_range}), {', '.join(scheme.read_list(ops, ALIAS))}"
                 f" FROM {ops.relation(t.schema_name, t.table_name, ALIAS)} WHERE {stale_where(scheme, None)}")
    yield from stream(conn, statement, params)


def _backlog_rows(conn: MySqlConnection, scheme: Scheme, tenant: str | None,
                  id_range: tuple[Any, Any]) -> Iterator[tuple[Any, int]]:
    """``(id, units to move)`` of every stale row of ``id_range`` holding any, in id order: one
    unbuffered pass, counted as PostgreSQL's ``drain.counting`` counts: a row the scheme's
    ``stale_condition`` selects is one unit, or, for a scheme whose reports count values (``fpc1``),
    each value it calls stale (UNKNOWN_KEY included: not on the current key, and no run moves it)."""
    values: CountsStaleValues | None = None
    if scheme.counts_values:
        if not isinstance(scheme, CountsStaleValues):
            raise TypeError(f"scheme {scheme.name} counts values but cannot count a row's stale values")
        values = scheme
    statement, params = select_batch(scheme, tenant, *id_range, None, None if values is not None else ())
    for row in stream(conn, statement, params):
        n = 1 if values is None else values.stale_values(row[1:])
        if n:
            yield row[0], n


def count_backlog(conn: MySqlConnection, scheme: Scheme, tenant: str | None, id_range: tuple[Any, Any]) -> int:
    """Rows (``aesgcm``, ``vault-transit``) or values (``fpc1``) still to move in ``id_range``, in scope."""
    return sum(n for _, n in _backlog_rows(conn, scheme, tenant, id_range))


def _estimated_rows(conn: MySqlConnection, t: TargetSettings) -> int:
    """``information_schema.TABLES.TABLE_ROWS``: InnoDB's estimate of the table's rows."""
    with conn.cursor() as cur:
        cur.execute("SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA = COALESCE(%s, DATABASE())"
                    " AND TABLE_NAME = %s", (t.schema_name, t.table_name))
        row = cur.fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _cumulative(conn: MySqlConnection, scheme: Scheme, tenant: str | None,
                id_range: tuple[Any, Any]) -> tuple[list[tuple[Any, int]], int]:
    """(points, total): the backlog of ``id_range`` counted exactly in one pass in id order, its
    cumulative count kept at no more than about ``SAMPLE_ROWS`` points ``(id, backlog up to and
    including it)``, spaced by the table's ``TABLE_ROWS`` estimate; the last stretch up to the open
    end as ``(None, total)``."""
    step = max(1, _estimated_rows(conn, scheme.target.settings) // SAMPLE_ROWS)
    points: list[tuple[Any, int]] = []
    total = 0
    for i, (row_id, n) in enumerate(_backlog_rows(conn, scheme, tenant, id_range)):
        total += n
        if i % step == 0:
            points.append((row_id, total))
    if points and points[-1][1] != total:
        points.append((None, total))
    return points, total


def _split(points: Sequence[tuple[Any, int]], total: int, wanted: int) -> tuple[list[Any], list[int]]:
    """Inner boundaries (ids, in the server's order) cutting ``total`` into ``wanted`` parts of
    similar counts at the points of ``_cumulative``, and each part's count."""
    bounds: list[Any] = []
    counts: list[int] = []
    before = 0
    for k in range(1, wanted):
        share = total * k // wanted
        at = next((p for p in points if p[1] >= share and p[0] is not None), None)
        if at is None or (bounds and at[0] == bounds[-1]) or at[1] >= total:
            continue
        bounds.append(at[0])
        counts.append(at[1] - before)
        before = at[1]
    counts.append(total - before)
    return bounds, counts


def range_bounds(conn: MySqlConnection, scheme: Scheme, tenant: str | None, id_range: tuple[Any, Any],
                 ranges: int) -> list[Any]:
    """Inner boundaries splitting the backlog of ``id_range`` between ``ranges`` workers of one drain
    (``job.max_degree_of_parallelism``), as PostgreSQL's ``ShardPlanner.range_bounds`` does: counted
    exactly (MySQL has no ``TABLESAMPLE``); fewer ranges where the backlog has fewer distinct points."""
    if ranges <= 1:
        return []
    points, total = _cumulative(conn, scheme, tenant, id_range)
    return _split(points, total, ranges)[0] if len(points) >= ranges else []


def plan_shards(engine: sa.Engine, scheme: Scheme, options: DrainOptions, shards: int) -> list[Shard]:
    """The target's backlog as at most ``shards`` id ranges ``(lo, hi]`` of similar counts, each
    counted exactly (``_cumulative``: one pass in id order). The outer ends are open, so rows that
    turn stale later still fall in a shard; ranges are merged until each holds at least
    ``MIN_BATCHES_PER_SHARD`` batches, as on PostgreSQL."""
    try:
        with mysql_connect.raw_connection(engine) as conn:
            if shards <= 1:
                return [Shard(options.id_range, count_backlog(conn, scheme, options.tenant, options.id_range))]
            points, total = _cumulative(conn, scheme, options.tenant, options.id_range)
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"target {scheme.target.name}: cannot plan the shards "
                            f"({mysql_connect.describe_db_error(e)})") from None
    wanted = min(shards, max(1, total // (MIN_BATCHES_PER_SHARD * options.batch_size)))
    lo, hi = options.id_range
    if wanted <= 1 or len(points) < wanted:
        return [Shard((lo, hi), total)]
    bounds, counts = _split(points, total, wanted)
    return [Shard(r, n) for r, n in zip(zip([lo, *bounds], [*bounds, hi]), counts)]
