"""Shard planning: a target's backlog cut into id ranges of similar row counts (quantiles of the
id over the stale rows, from every stale id or from a page sample of a big table), merged until
each range is worth a worker. Reads only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa

from ..db import describe_db_error, raw_connection, read_only_when
from ..engines.postgresql import estimates as pg_estimates
from ..errors import DatabaseError
from ..log import log_event
from ..schemes.base import Scheme
from .counting import BacklogCounter
from .options import DrainOptions
from .selection import Selection

SAMPLE_ROWS = 50_000  # stale rows whose ids a shard plan sorts, at most (see ShardPlanner.range_bounds)
MIN_SAMPLE_PER_RANGE = 100  # a sample with fewer stale rows per range is not used
MIN_BATCHES_PER_SHARD = 25


@dataclass(frozen=True)
class Shard:
    """One id range ``(lo, hi]`` of a target's backlog (None: open end) and its backlog in rows:
    counted when ``exact``, else estimated from a page sample."""

    id_range: tuple[Any, Any]
    rows: int
    exact: bool = True


class ShardPlanner:
    """Boundaries that cut the backlog of one target (within ``id_range``) into ranges."""

    def __init__(self, selection: Selection, id_range: tuple[Any, Any], run_id: str = "") -> None:
        self.selection = selection
        self.target = selection.target
        self.id_range = id_range
        self.run_id = run_id

    def range_bounds(self, conn: psycopg.Connection[Any], ranges: int, backlog: int) -> list[Any]:
        """Inner boundaries splitting the backlog's ids (within ``id_range``) into ``ranges`` ranges of
        about equal row counts (see ``_sampled_bounds``)."""
        return self._sampled_bounds(conn, ranges, backlog)[0]

    def estimated_rows(self, conn: psycopg.Connection[Any]) -> int:
        """The planner's estimate of the table's rows (pg_class.reltuples; 0 when never analyzed)."""
        return pg_estimates.estimated_rows(conn, self.target.relation)

    def _sampled_bounds(self, conn: psycopg.Connection[Any], ranges: int,
                        backlog: int) -> tuple[list[Any], int | None]:
        """Inner boundaries splitting the backlog's ids (within ``id_range``) into ``ranges`` ranges of
        about equal row counts: quantiles of the id over the stale rows. When ``backlog`` (rows, or an
        estimate of the table's rows) is big, the quantiles of a sample of the table's pages
        (``TABLESAMPLE SYSTEM``) of about SAMPLE_ROWS rows, so that a plan never sorts a huge
        table's ids. (bounds, the stale rows the sample stands for: ``backlog`` times the sample's
        stale share, with ``backlog`` the planner's estimate of the table's rows), the second None
        when every stale id was sorted."""
        if ranges <= 1:
            return [], None
        s = self.selection
        conds, params = s.range(*self.id_range)
        fractions = [i / ranges for i in range(1, ranges)]

        def quantiles(sample_percent: float | None) -> tuple[int, list[Any], int]:
            """(stale rows seen, the inner boundaries, rows seen) over the whole table (rows seen: the
            stale ones), or over a page sample of it (rows seen: every row of the sampled pages)."""
            query, args = pg_estimates.id_quantiles(s.id, self.target.relation, s.stale_in(conds), params, fractions,
                                                    sample_percent)
            row = conn.execute(query, args).fetchone()
            if not row:
                return 0, [], 0
            stale = int(row[0])
            # In the server's order (percentile_disc returns them ascending by the key's own
            # collation and operators), never re-sorted here: Python's order of a text key is not
            # the server's under a natural collation, and the ranges would overlap.
            bounds = list(dict.fromkeys(b for b in row[1] or [] if b is not None))
            return stale, bounds, stale if sample_percent is None else int(row[2])

        if backlog > 2 * SAMPLE_ROWS:
            sampled, bounds, seen = quantiles(100.0 * SAMPLE_ROWS / backlog)
            if sampled >= MIN_SAMPLE_PER_RANGE * ranges:  # else too few stale rows in the sample: all of them
                log_event("shards_sampled", level=10, run_id=self.run_id or None, target=self.target.name,
                          backlog=backlog, sampled=sampled, ranges=ranges)
                return bounds, round(backlog * sampled / seen)
        return quantiles(None)[1], None


def split_backlog(engine: sa.Engine, scheme: Scheme, options: DrainOptions, shards: int) -> list[Shard]:
    """The stale, in-scope ids of a target as at most ``shards`` ranges ``(lo, hi]`` of similar row
    counts (quantiles of the id over the stale rows), each with its backlog; the outer ends are open,
    so rows that turn stale later still fall in a shard. One range when there is little or nothing to do.

    Cheap however big the table: when it is big (over 2 x SAMPLE_ROWS by the planner's estimate of
    its rows), the quantiles come from a sample of its pages (``ShardPlanner._sampled_bounds``) and
    each shard's backlog is estimated from the sample, not counted: a counting scan of a huge table
    here would keep every worker waiting. (Counting each shard's range instead is no cheaper: with
    random UUID ids, one range's rows lie on nearly every page.) What a shard leaves is counted
    when it ends. A smaller table's stale ids are sorted whole and every range counted exactly, in
    one scan each.
    Adjacent ranges are then merged until each holds at least MIN_BATCHES_PER_SHARD batches.
    """
    selection = Selection(scheme, options.tenant)
    counter = BacklogCounter(scheme, selection, options.id_range)
    planner = ShardPlanner(selection, options.id_range, options.run_id)
    try:
        with raw_connection(engine) as conn, read_only_when(conn, options.dry_run):
            bounds, estimated = (planner._sampled_bounds(conn, shards, planner.estimated_rows(conn)) if shards > 1
                                 else ([], None))
            if not bounds:
                return [Shard((None, None), counter.count_backlog(conn))]
            if estimated is None:
                counts = counter.count_ranges(conn, bounds)
            else:  # each range holds an equal share of the sample
                share, extra = divmod(estimated, len(bounds) + 1)
                counts = [share + (1 if i < extra else 0) for i in range(len(bounds) + 1)]
            # A shard has fixed costs (connections, counts, filling and emptying the pipeline): below
            # MIN_BATCHES_PER_SHARD batches they outweigh what one more shard spreads.
            wanted = min(len(counts), max(1, sum(counts) // (MIN_BATCHES_PER_SHARD * options.batch_size)))
            bounds, counts = _merge_ranges(bounds, counts, wanted)
            return [Shard(r, n, exact=estimated is None) for r, n in zip(zip([None, *bounds], [*bounds, None]), counts)]
    except psycopg.Error as e:
        raise DatabaseError(f"target {scheme.target.name}: cannot split the backlog ({describe_db_error(e)})") from None


def _merge_ranges(bounds: Sequence[Any], counts: Sequence[int], wanted: int) -> tuple[list[Any], list[int]]:
    """Adjacent ranges (``bounds`` between them, a count each) merged into ``wanted`` ranges of
    similar counts; the counts add up, so they stay exact. Each cut goes at the boundary nearest
    its share of the total (k/wanted of it), not at the first one past it: eight ranges of about
    25,000 rows merge into four of about 50,000, never 75k + 50k + 50k + 25k, which would leave
    one of two workers idle for a quarter of the run."""
    if wanted >= len(counts):
        return list(bounds), list(counts)
    total = sum(counts)
    kept: list[Any] = []
    merged: list[int] = []
    acc = run = 0
    for i, n in enumerate(counts[:-1]):
        acc += n
        run += n
        cuts_left = wanted - 1 - len(kept)
        if not cuts_left:
            continue
        share = (len(kept) + 1) * total / wanted
        # Cut here when this boundary is at least as near the share as the next one, or when every
        # range left must be a shard of its own to make ``wanted``.
        if len(counts) - 1 - i <= cuts_left or abs(acc - share) <= abs(acc + counts[i + 1] - share):
            kept.append(bounds[i])
            merged.append(run)
            run = 0
    merged.append(run + counts[-1])
    return kept, merged
