"""The batch drain: move every in-scope value of a target from older keys to the current key.

One pipeline for every scheme: keyset pagination by id (``id > last``) over the rows the scheme
calls stale and the scope rule admits, one transaction per batch, the scheme's write guard (rows
locked ``FOR NO KEY UPDATE SKIP LOCKED``, or compare-and-swap on the values read), set-based
writes, workers owning disjoint id ranges, sweeps for rows that were locked by someone else (a
compare-and-swap write locks its rows ``SKIP LOCKED`` too: it never waits on an application), stop
rules between batches, and a durability barrier before it reports. A provider failure rolls the
open batch back and stops the target; a value that does not decrypt is left unchanged and
reported. It never writes anything but the cipher columns (and the key-version column), and never
a row out of scope.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from .db import describe_db_error, raw_connection
from .durability import force_flush
from .errors import DatabaseError, KeyUnavailable, ThrottleCritical
from .log import log_event
from .schemes.base import BatchPlan, FailedRow, Scheme, Write
from .scope import scope_condition
from .state import NO_TENANT, StateError, record_conflicts
from .targets import begin_writing_batch

if TYPE_CHECKING:
    from .throttle import Throttle

# Why a drain stopped before its backlog was empty.
STOP_KEY_UNAVAILABLE = "key_unavailable"
STOP_DB_ERROR = "db_error"
STOP_CANCELLED = "cancelled"
STOP_DEADLINE = "deadline"
STOP_THROTTLE_CRITICAL = "throttle_critical"  # a critical_* health limit was exceeded (exit 4)
# The run's orchestrator (the flows' Prefect API) stopped answering: stopped between batches (exit 4).
STOP_ORCHESTRATOR_LOST = "orchestrator_lost"

MAX_SWEEPS = 5
SAMPLE_SIZE = 64
SCAN_ROWS = 5000
SAMPLE_ROWS = 50_000  # stale rows whose ids a shard plan sorts, at most (see Drain._range_bounds)
MIN_SAMPLE_PER_RANGE = 100  # a sample with fewer stale rows per range is not used
MIN_BATCHES_PER_SHARD = 25
HALT_POLL = 0.05  # seconds: how soon a reader waiting between batches sees its pass end

# Test and instrumentation hook: (batch number, ids read) after a batch is planned, before its write.
BeforeWrite = Callable[[int, Sequence[Any]], None]


@dataclass(frozen=True)
class DrainOptions:
    batch_size: int = 200
    workers: int = 1
    inter_batch_delay: float = 0.0
    deadline: float | None = None  # time.monotonic() value; the rest is left for the next run
    dry_run: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    on_batch: Callable[[BatchEvent], None] | None = None
    run_id: str = ""
    tenant: str | None = None  # only this tenant's rows (targets with a tenant column)
    id_range: tuple[Any, Any] = (None, None)  # a shard: ids in (lo, hi]; None = open end
    # The backlog of id_range as counted when the shard was planned (split_backlog): the drain's
    # backlog_before, not counted again. None or 0: the drain counts it.
    planned_backlog: int | None = None
    lock_timeout: float = 2.0  # seconds a batch waits for a lock before it rolls back
    statement_timeout: float = 30.0  # seconds one statement of a batch may run
    idle_timeout: float = 60.0  # seconds a batch transaction may sit between statements (then the server ends it)
    before_write: BeforeWrite | None = None
    # Sharing the database (throttle.py): when set, it gives the batch size and waits between
    # batches instead of inter_batch_delay (in the reader thread, before the next batch is locked).
    throttle: Throttle | None = None


@dataclass(frozen=True)
class BatchEvent:
    target: str
    worker: int
    batch: int
    rows: int
    reencrypted: int
    failed: int
    duration_ms: float  # lock (or read) to commit, without the pause between batches
    dry_run: bool
    conflicts: int = 0


@dataclass
class DrainResult:
    target: str
    current_key: str
    reencrypted: int = 0  # rows (aesgcm, vault-transit) or values (fpc1)
    failed: list[FailedRow] = field(default_factory=list)
    conflicts: int = 0
    batches: int = 0
    duration_ms: float = 0.0
    backlog_before: int = 0
    backlog_remaining: int = 0
    stopped: str | None = None
    error: str | None = None
    retryable: bool = False
    dry_run: bool = False
    sample_ids: list[Any] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # scheme counts: active, unknown, unknown_key, ...
    conflicts_by_tenant: dict[str, int] = field(default_factory=dict)
    state_error: str | None = None  # the CONFLICT counts could not be saved for the gate
    notes: list[str] = field(default_factory=list)  # what the counts do not say (counts lost with a worker, ...)

    @property
    def unknown(self) -> int:
        return self.counts.get("unknown", 0)

    @property
    def unknown_key(self) -> int:
        return self.counts.get("unknown_key", 0)

    @property
    def legacy_left(self) -> int:
        return self.counts.get("legacy_left", 0)

    @property
    def fail_closed(self) -> bool:
        """True when the run must report exit code 4 for this target."""
        return (self.stopped in (STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL, STOP_ORCHESTRATOR_LOST)
                or bool(self.failed)
                or self.conflicts > 0 or self.state_error is not None)


def natural_id_order(row_id: str) -> tuple[int, int, str]:
    """Ids in the order an operator expects: numbers numerically (1, 2, 10), then the rest as text."""
    return (0, int(row_id), "") if row_id.isdigit() else (1, 0, row_id)


@dataclass
class _Outcome:
    """What one batch's writes did, counted only once its COMMIT is confirmed."""

    reencrypted: int = 0
    conflicts: int = 0
    settled: int = 0  # CAS misses whose value another run had already moved
    lost: list[tuple[Any, str, str, int]] = field(default_factory=list)  # (id, column, tenant, values)
    held: list[Any] = field(default_factory=list)  # cas: ids of rows someone else held locked, left for the sweep
    committed: float = 0.0  # perf_counter() at COMMIT


@dataclass(frozen=True)
class _Fetched:
    """A batch the reader thread read (and, with the lock guard, locked)."""

    rows: list[tuple[Any, ...]]
    size: int  # rows asked for: fewer came back only at the end of the range
    locked: float  # perf_counter() at its BEGIN: the start of its lock hold


class _AnyEvent:
    """Set when any of its events is set: the reader's wait ends on a stop, the end of its pass,
    or a sibling worker's fail-closed stop. The first event wakes a wait at once, the others
    within ``HALT_POLL`` seconds."""

    def __init__(self, *events: threading.Event) -> None:
        self._events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._events[0].wait(HALT_POLL if remaining is None else min(HALT_POLL, remaining))
        return True


@dataclass(frozen=True)
class _Pending:
    """A batch handed to the writer thread."""

    future: Future[_Outcome]
    worker: int
    batch_no: int
    rows: int
    plan: BatchPlan
    started: float


class _Tally:
    """Per-target counters shared by the workers of one drain."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reencrypted = 0
        self.conflicts = 0
        self.batches = 0
        self.counts: dict[str, int] = {}
        self.conflicts_by_tenant: dict[str, int] = {}
        self.failed: dict[tuple[str, str], FailedRow] = {}
        self.held: set[Any] = set()  # cas: rows someone else held locked at the write, for the sweep
        self.error: BaseException | None = None
        self.sample: list[Any] = []  # reservoir of re-encrypted ids, re-read by the verify step
        self._seen = 0
        self._rng = random.Random()

    def add(self, plan: BatchPlan, outcome: _Outcome) -> None:
        with self.lock:
            self.reencrypted += outcome.reencrypted
            self.conflicts += outcome.conflicts
            self.batches += 1
            for name, n in plan.counts.items():
                self.counts[name] = self.counts.get(name, 0) + n
            if outcome.settled:
                self.counts["settled_elsewhere"] = self.counts.get("settled_elsewhere", 0) + outcome.settled
            self.held.update(outcome.held)
            for _, _, tenant, n in outcome.lost:
                self.conflicts_by_tenant[tenant] = self.conflicts_by_tenant.get(tenant, 0) + n
            for f in plan.failed:
                self.failed.setdefault((f.id, f.reason), f)
            ids = plan.writes[0].ids if len(plan.writes) == 1 else plan.ids
            if ids:
                for row_id in (ids[0], self._rng.choice(ids)):
                    self._seen += 1
                    if len(self.sample) < SAMPLE_SIZE:
                        self.sample.append(row_id)
                    else:
                        slot = self._rng.randrange(self._seen)
                        if slot < SAMPLE_SIZE:
                            self.sample[slot] = row_id

    def failed_ids(self) -> frozenset[str]:
        with self.lock:
            return frozenset(i for i, _ in self.failed)

    def take_held(self) -> frozenset[Any]:
        """The rows left because someone else held them locked, forgotten here (a sweep tries them again)."""
        with self.lock:
            held, self.held = frozenset(self.held), set()
            return held


class Drain:
    """The drain of one target through its scheme (see the module docstring)."""

    def __init__(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> None:
        self.engine = engine
        self.scheme = scheme
        self.target = scheme.target
        self.options = options
        self.tally = _Tally()
        self._stop_target = threading.Event()  # one worker's fail-closed stop stops its siblings
        self._locks = scheme.guard == "lock" and not options.dry_run
        settings = self.target.settings
        self._id = sql.Identifier(settings.id)
        # THE scope rule, composed once: bare for reads and counts, aliased "t" for update guards.
        self._scope = scope_condition(settings, options.tenant)
        self._scope_t = scope_condition(settings, options.tenant, "t")
        self._where = sql.SQL("{} AND {}").format(scheme.stale_condition(), self._scope)
        self._where_t = sql.SQL("{} AND {}").format(scheme.stale_condition("t"), self._scope_t)
        self._statements: dict[tuple[int, ...], sql.Composed] = {}

    # -- SQL ---------------------------------------------------------------------------------

    def _range(self, lo: Any, hi: Any) -> tuple[list[sql.Composable], list[Any]]:
        conds: list[sql.Composable] = []
        params: list[Any] = []
        if lo is not None:
            conds.append(sql.SQL("{} > %s").format(self._id))
            params.append(lo)
        if hi is not None:
            conds.append(sql.SQL("{} <= %s").format(self._id))
            params.append(hi)
        return conds, params

    def _select(self, lo: Any, hi: Any, size: int) -> tuple[sql.Composed, list[Any]]:
        conds, params = self._range(lo, hi)
        lock = sql.SQL(" FOR NO KEY UPDATE SKIP LOCKED") if self._locks else sql.SQL("")
        query = sql.SQL("SELECT {id}, {cols} FROM {rel} WHERE {where} ORDER BY {id} LIMIT %s{lock}").format(
            id=self._id, cols=sql.SQL(", ").join(self.scheme.read_list()), rel=self.target.relation,
            where=sql.SQL(" AND ").join([self._where, *conds]), lock=lock)
        return query, [*params, size]

    def _update(self, write: Write) -> sql.Composed:
        """One set-based statement for a write; arrays are cast to base types (``varchar``, never
        ``varchar(n)``), so a value too long for its column is an error that rolls the batch back,
        never a silent truncation."""
        cached = self._statements.get(write.columns)
        if cached is not None:
            return cached
        columns = [self.target.columns[j] for j in write.columns]
        id_type = sql.SQL("{}[]").format(sql.Identifier(self.target.id_column.type_name))
        arrays: list[sql.Composable]
        if self.scheme.guard == "lock":
            arrays = [sql.SQL("%b::{}").format(id_type)]
            arrays += [sql.SQL("%b::{}[]").format(sql.Identifier(c.type_name)) for c in columns]
            names = [sql.Identifier(f"n{i}") for i in range(len(columns))]
            sets = [sql.SQL("{} = u.{}").format(sql.Identifier(c.name), n) for c, n in zip(columns, names)]
            kv = self.scheme.key_version_column()
            if kv is not None:
                sets.append(sql.SQL("{} = {}").format(sql.Identifier(kv.name), sql.Literal(int(self.scheme.current_key))))
            # Guard: the locked row is still stale and in scope (it cannot have changed, but never write blind).
            statement = sql.SQL(
                "UPDATE {rel} AS t SET {sets} FROM unnest({arrays}) AS u(pinrotate_id, {names}) "
                "WHERE t.{id} = u.pinrotate_id AND {guard}"
            ).format(rel=self.target.relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
                     names=sql.SQL(", ").join(names), id=self._id, guard=self._where_t)
        else:
            arrays = [sql.SQL("%s::{}").format(id_type)]
            arrays += [sql.SQL("%s::text[]")] * (2 * len(columns))
            names = []
            sets = []
            same = []
            for i, c in enumerate(columns):
                old, new = sql.Identifier(f"o{i}"), sql.Identifier(f"n{i}")
                names += [old, new]
                ref = sql.Identifier("t", c.name)
                if c.type_name == "jsonb":
                    sets.append(sql.SQL("{} = u.{}::jsonb").format(sql.Identifier(c.name), new))
                    same.append(sql.SQL("{} = u.{}::jsonb").format(ref, old))
                elif c.type_name == "json":
                    sets.append(sql.SQL("{} = u.{}::json").format(sql.Identifier(c.name), new))
                    same.append(sql.SQL("{}::text = u.{}").format(ref, old))
                else:
                    sets.append(sql.SQL("{} = u.{}").format(sql.Identifier(c.name), new))
                    same.append(sql.SQL("{} = u.{}").format(ref, old))
            # Lock first, never wait: a row an application holds locked is skipped (left for the
            # sweep or the next run, as the lock guard's SKIP LOCKED leaves it), the others are
            # locked and written where they still hold the values read. (true, id) per row
            # written, (false, id) per row locked.
            statement = sql.SQL(
                "WITH pinrotate_locked AS MATERIALIZED ("
                "SELECT u.* FROM unnest({arrays}) AS u(pinrotate_id, {names}) JOIN {rel} AS t "
                "ON t.{id} = u.pinrotate_id FOR NO KEY UPDATE OF t SKIP LOCKED), "
                "pinrotate_moved AS (UPDATE {rel} AS t SET {sets} FROM pinrotate_locked AS u "
                "WHERE t.{id} = u.pinrotate_id AND {same} AND {scope} RETURNING t.{id} AS pinrotate_id) "
                "SELECT true, pinrotate_id FROM pinrotate_moved UNION ALL SELECT false, pinrotate_id FROM pinrotate_locked"
            ).format(rel=self.target.relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
                     names=sql.SQL(", ").join(names), id=self._id, same=sql.SQL(" AND ").join(same),
                     scope=self._scope_t)
        self._statements[write.columns] = statement
        return statement

    def count_backlog(self, conn: psycopg.Connection[Any], exclude: frozenset[str] = frozenset(),
                      id_range: tuple[Any, Any] | None = None) -> int:
        """Rows (or values, for value-counting schemes) still to move, in scope."""
        if not self.scheme.counts_values:
            return self._count_rows(conn, exclude, id_range)[0 if not exclude else 1]
        return self._count_values(conn, exclude, id_range)

    def _count_rows(self, conn: psycopg.Connection[Any], exclude: frozenset[str] = frozenset(),
                    id_range: tuple[Any, Any] | None = None) -> tuple[int, int]:
        """Stale rows in scope: (all of them, those whose id is not in ``exclude``), in one scan."""
        conds, params = self._range(*(id_range or self.options.id_range))
        where = sql.SQL(" AND ").join([self._where, *conds])
        unfailed: sql.Composable = sql.SQL("")  # without exclude, the one count serves as both
        if exclude:
            unfailed = sql.SQL(", count(*) FILTER (WHERE NOT ({}::text = ANY(%s)))").format(self._id)
            params.insert(0, list(exclude))
        query = sql.SQL("SELECT count(*){unfailed} FROM {rel} WHERE {where}").format(
            unfailed=unfailed, rel=self.target.relation, where=where)
        with conn.transaction():
            _walk_the_range(conn, conds)
            row = conn.execute(query, params).fetchone()
        return (int(row[0]), int(row[-1])) if row else (0, 0)

    def _count_left(self, conn: psycopg.Connection[Any], failed: frozenset[str]) -> tuple[int, int]:
        """The backlog (all of it, and without the rows that failed): one scan for row counts."""
        if not self.scheme.counts_values:
            return self._count_rows(conn, failed)
        return self._count_values(conn, frozenset(), None), self._count_values(conn, failed, None)

    def _count_values(self, conn: psycopg.Connection[Any], exclude: frozenset[str],
                      id_range: tuple[Any, Any] | None) -> int:
        conds, params = self._range(*(id_range or self.options.id_range))
        where = sql.SQL(" AND ").join([self._where, *conds])
        query = sql.SQL("SELECT {id}, {cols} FROM {rel} WHERE {where}").format(
            id=self._id, cols=sql.SQL(", ").join(self.scheme.read_list()), rel=self.target.relation, where=where)
        stale = 0
        with conn.transaction(), conn.cursor(name="pinrotate_backlog") as cur:
            _walk_the_range(conn, conds)
            cur.itersize = SCAN_ROWS
            cur.execute(query, params)
            for row in cur:
                if str(row[0]) not in exclude:
                    stale += self.scheme.stale_values(row[1:])
        return stale

    def _count_ranges(self, conn: psycopg.Connection[Any], bounds: Sequence[Any]) -> list[int]:
        """The backlog of each range that ``bounds`` cut ``id_range`` into; one scan for row counts."""
        lo, hi = self.options.id_range
        if self.scheme.counts_values:
            return [self.count_backlog(conn, id_range=r) for r in zip([lo, *bounds], [*bounds, hi])]
        conds, params = self._range(lo, hi)  # the outer ends; each FILTER below cuts between bounds
        filters: list[sql.Composable] = []
        filter_params: list[Any] = []
        for a, b in zip([None, *bounds], [*bounds, None]):
            cut, cut_params = self._range(a, b)
            filters.append(sql.SQL("count(*) FILTER (WHERE {})").format(sql.SQL(" AND ").join(cut or [sql.SQL("true")])))
            filter_params += cut_params
        query = sql.SQL("SELECT {counts} FROM {rel} WHERE {where}").format(
            counts=sql.SQL(", ").join(filters), rel=self.target.relation,
            where=sql.SQL(" AND ").join([self._where, *conds]))
        row = conn.execute(query, [*filter_params, *params]).fetchone()
        return [int(n) for n in row] if row else [0] * (len(bounds) + 1)

    def _estimated_rows(self, conn: psycopg.Connection[Any]) -> int:
        """The planner's estimate of the table's rows (pg_class.reltuples; 0 when never analyzed)."""
        row = conn.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                           [self.target.relation.as_string(conn)]).fetchone()
        return max(0, int(row[0])) if row and row[0] is not None else 0

    def _range_bounds(self, conn: psycopg.Connection[Any], ranges: int, backlog: int) -> list[Any]:
        """Inner boundaries splitting the backlog's ids (within ``id_range``) into ``ranges`` ranges of
        about equal row counts (see ``_sampled_bounds``)."""
        return self._sampled_bounds(conn, ranges, backlog)[0]

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
        conds, params = self._range(*self.options.id_range)
        fractions = [i / ranges for i in range(1, ranges)]

        def quantiles(sample_percent: float | None) -> tuple[int, list[Any], int]:
            """(stale rows seen, the inner boundaries, rows seen) over the whole table (rows seen: the
            stale ones), or over a page sample of it (rows seen: every row of the sampled pages)."""
            where = sql.SQL(" AND ").join([self._where, *conds])
            if sample_percent is None:
                query = sql.SQL("SELECT count(*), percentile_disc(%s::float8[]) WITHIN GROUP (ORDER BY {id}) "
                                "FROM {rel} WHERE {where}").format(id=self._id, rel=self.target.relation, where=where)
                args = [fractions, *params]
            else:  # every row of the sampled pages is seen: its stale share scales the planner's estimate
                query = sql.SQL(
                    "SELECT count(*) FILTER (WHERE s.stale), percentile_disc(%s::float8[]) WITHIN GROUP "
                    "(ORDER BY s.pinrotate_id) FILTER (WHERE s.stale), count(*) "
                    "FROM (SELECT {id} AS pinrotate_id, ({where}) AS stale FROM {rel} TABLESAMPLE SYSTEM (%s)) AS s"
                ).format(id=self._id, rel=self.target.relation, where=where)
                args = [fractions, *params, sample_percent]
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
                log_event("shards_sampled", level=10, run_id=self.options.run_id or None, target=self.target.name,
                          backlog=backlog, sampled=sampled, ranges=ranges)
                return bounds, round(backlog * sampled / seen)
        return quantiles(None)[1], None

    # -- one batch ---------------------------------------------------------------------------

    def _should_stop(self) -> str | None:
        return stop_reason(self.options, self._stop_target)

    def _next_batch(self, conn: psycopg.Connection[Any], lo: Any, hi: Any, first: bool,
                    halt: _AnyEvent) -> _Fetched | None:
        """Reader thread: wait until the next batch may start (throttle, or ``inter_batch_delay``)
        while holding nothing, then BEGIN and read it. None: the pass stopped before it began."""
        opts = self.options
        size = opts.batch_size
        if opts.throttle is not None:
            opts.throttle.before_batch(halt, opts.deadline, first=first)
            size = opts.throttle.batch_size
        elif opts.inter_batch_delay and not first:
            halt.wait(opts.inter_batch_delay)
        if halt.is_set() or self._should_stop():
            return None
        locked = time.perf_counter()
        return _Fetched(self._fetch(conn, lo, hi, size), size, locked)

    def _fetch(self, conn: psycopg.Connection[Any], lo: Any, hi: Any, size: int) -> list[tuple[Any, ...]]:
        """BEGIN and read (with the lock guard: lock) the next batch after ``lo`` (reader thread)."""
        query, params = self._select(lo, hi, size)
        conn.execute("BEGIN")
        try:
            if not self.options.dry_run:
                begin_writing_batch(conn, self.target)  # triggers = "disable": SET LOCAL session_replication_role
                # Per batch: never wait long for a lock an application holds, never run away, and
                # never hold rows for ever: the server ends a batch transaction left idle longer
                # than idle_timeout (a stuck key provider, a frozen process), which rolls it back.
                for name, seconds in (("lock_timeout", self.options.lock_timeout),
                                      ("statement_timeout", self.options.statement_timeout),
                                      ("idle_in_transaction_session_timeout", self.options.idle_timeout)):
                    conn.execute(sql.SQL("SET LOCAL {} = {}").format(sql.Identifier(name),
                                                                     sql.Literal(f"{int(seconds * 1000)}ms")))
            return conn.cursor(binary=True).execute(query, params).fetchall()
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
            raise

    def _write(self, conn: psycopg.Connection[Any], plan: BatchPlan) -> _Outcome:
        """The batch's writes and COMMIT (writer thread); ROLLBACK on any error: whole or nothing."""
        outcome = _Outcome()
        try:
            for write in plan.writes:
                if not write.ids:
                    continue
                if self.scheme.guard == "lock":
                    cur = conn.cursor(binary=True)
                    cur.execute(self._update(write), [write.ids, *write.new])
                    if cur.rowcount != len(write.ids):
                        # Cannot happen while we hold the row locks; if it does, write nothing.
                        raise DatabaseError(f"target {self.target.name}: batch updated {cur.rowcount} rows, "
                                            f"expected {len(write.ids)}")
                    outcome.reencrypted += sum(write.weights)
                else:
                    self._compare_and_swap(conn, write, outcome)
            conn.execute("COMMIT")
            outcome.committed = time.perf_counter()
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
            raise
        return outcome

    def _compare_and_swap(self, conn: psycopg.Connection[Any], write: Write, outcome: _Outcome) -> None:
        params: list[Any] = [write.ids]
        for old, new in zip(write.old, write.new):
            params += [old, new]
        matched: set[Any] = set()
        locked: set[Any] = set()
        for moved, row_id in conn.execute(self._update(write), params).fetchall():
            (matched if moved else locked).add(row_id)
        # Not locked: someone else holds the row (or it is gone); locked but not written: a miss.
        missed = [i for i, row_id in enumerate(write.ids) if row_id not in matched]
        settled: set[Any] = set()
        held: set[Any] = set()
        if missed:
            # A miss whose value is already on the current key was moved by another run: not a
            # conflict. A row we could not lock that is still there (in scope) is held by someone
            # else: left as it is, for the sweep. A row that is gone is a conflict, as before.
            columns = [self.target.columns[j] for j in write.columns]
            query = sql.SQL("SELECT {id}, {cols} FROM {rel} WHERE {id} = ANY(%s) AND {scope}").format(
                id=self._id, cols=sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c.name))
                                                     for c in columns),
                rel=self.target.relation, scope=self._scope)
            read = {write.ids[i]: [old[i] for old in write.old] for i in missed}
            for row in conn.execute(query, [list(read)]).fetchall():
                if row[0] not in locked:
                    held.add(row[0])
                elif all(self.scheme.settled(c, r, v) for c, r, v in zip(columns, read[row[0]], row[1:])):
                    settled.add(row[0])
        column = ",".join(self.target.columns[j].name for j in write.columns)
        for i, row_id in enumerate(write.ids):
            if row_id in matched:
                outcome.reencrypted += write.weights[i]
            elif row_id in settled:
                outcome.settled += write.weights[i]
            elif row_id in held:
                outcome.held.append(row_id)
            else:
                outcome.conflicts += write.weights[i]
                outcome.lost.append((row_id, column, write.tenants[i] or NO_TENANT, write.weights[i]))

    def _record(self, worker: int, batch_no: int, rows: int, plan: BatchPlan, outcome: _Outcome,
                started: float) -> None:
        """Count a committed (or, in a dry run, computed) batch and tell the world."""
        opts = self.options
        name = self.target.name
        self.tally.add(plan, outcome)
        event = BatchEvent(name, worker, batch_no, rows, outcome.reencrypted, len(plan.failed),
                           ((outcome.committed or time.perf_counter()) - started) * 1000, opts.dry_run,
                           conflicts=outcome.conflicts)
        log_event("batch_processed", run_id=opts.run_id or None, target=name, worker=worker, batch=batch_no,
                  rows=rows, reencrypted=event.reencrypted, failed=event.failed, conflicts=event.conflicts or None,
                  held_by_others=len(outcome.held) or None,
                  unknown=plan.counts.get("unknown") or None, legacy_left=plan.counts.get("legacy_left") or None,
                  duration_ms=round(event.duration_ms, 1), dry_run=opts.dry_run or None)
        for f in plan.failed:
            log_event("row_failed", level=30, run_id=opts.run_id or None, target=name, id=f.id,
                      columns=list(f.columns), reason=f.reason)
        for row_id, column, _, n in outcome.lost:
            log_event("value_conflict", level=30, run_id=opts.run_id or None, target=name, id=str(row_id),
                      column=column, values=n)
        if opts.on_batch is not None:
            opts.on_batch(event)

    def _settle(self, pending: _Pending) -> None:
        outcome = pending.future.result()  # re-raises the writer's error after its ROLLBACK
        self._record(pending.worker, pending.batch_no, pending.rows, pending.plan, outcome, pending.started)

    # -- a pass --------------------------------------------------------------------------------

    def _pass(self, worker: int, lo: Any, hi: Any, only: frozenset[Any] | None = None) -> str | None:
        """One keyset pass over ``(lo, hi]``; returns why it stopped early, or None when done. With
        ``only`` (a compare-and-swap sweep), only those rows are planned and written.

        Pipelined over three connections: while this thread re-encrypts batch N, a reader thread
        reads (and locks) batch N+1 and a writer thread sends batch N-1's writes and COMMIT, so the
        database and the crypto work overlap. Each batch is still exactly one transaction on one
        connection, and is counted only once its COMMIT is confirmed. Every wait between batches
        (the throttle, ``inter_batch_delay``) happens in the reader before it BEGINs the next
        batch, so no wait ever holds a row lock: a row is locked from its batch's SELECT to its
        COMMIT, which spans the re-encryption of the batch before it and of its own (see
        ``reference.md``, "How long a row stays locked").
        """
        opts = self.options
        t = self.target
        dry = opts.dry_run
        throttle = opts.throttle
        reason: str | None = None
        halt_pass = threading.Event()  # set when this pass ends: a reader waiting for the throttle gives up
        halt = _AnyEvent(opts.stop, halt_pass, self._stop_target)
        with contextlib.ExitStack() as stack:
            conns = [stack.enter_context(raw_connection(self.engine)) for _ in range(2 if dry else 3)]
            for c in conns:
                prepare_session(c, dry)
            reader = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"read-{t.name}"))
            writer = None if dry else stack.enter_context(
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"write-{t.name}"))
            k = 0
            pending: _Pending | None = None
            open_tx: psycopg.Connection[Any] | None = None
            # In a copy of this thread's context, as the workers are: the throttle's log lines
            # reach an orchestrator's run log.
            next_fetch: Future[_Fetched | None] | None = reader.submit(
                contextvars.copy_context().run, self._next_batch, conns[0], lo, hi, True, halt)
            try:
                while next_fetch is not None:
                    conn = conns[k % len(conns)]
                    fetching, next_fetch = next_fetch, None
                    fetched = fetching.result()  # a failed fetch has rolled its own transaction back
                    if fetched is None:  # stopped before it began: nothing was read
                        reason = self._should_stop() or STOP_CANCELLED
                        break
                    rows, started = fetched.rows, fetched.locked
                    open_tx = conn
                    if not rows:
                        break
                    reason = self._should_stop()
                    if reason:
                        break  # this batch was only read: it rolls back below
                    if len(rows) == fetched.size:  # more to come: lock the next batch while this one is worked
                        next_fetch = reader.submit(contextvars.copy_context().run, self._next_batch,
                                                   conns[(k + 1) % len(conns)], rows[-1][0], hi, False, halt)
                    if only is not None:
                        rows = [r for r in rows if r[0] in only]
                    plan = self.scheme.plan(rows, self.tally.failed_ids())
                    if opts.before_write is not None:
                        opts.before_write(k + 1, [r[0] for r in rows])
                    if pending is not None:
                        self._settle(pending)
                        pending = None
                    if writer is None:
                        conn.execute("ROLLBACK")
                        open_tx = None
                        self._record(worker, k + 1, len(rows), plan, _Outcome(reencrypted=plan.planned), started)
                    else:
                        pending = _Pending(writer.submit(self._write, conn, plan), worker, k + 1, len(rows), plan,
                                           started)
                        open_tx = None  # the writer owns this transaction now
                        if throttle is not None:  # lock-to-commit time feeds the batch sizer
                            pending.future.add_done_callback(_feeds_sizer(throttle, started, len(rows)))
                    k += 1
                if open_tx is not None:
                    open_tx.execute("ROLLBACK")
                    open_tx = None
                if pending is not None:
                    self._settle(pending)
                    pending = None
            except BaseException:
                # Fail closed: a batch being planned rolls back; a write in flight either commits
                # whole or rolls itself back. Nothing is half-written.
                halt_pass.set()
                if open_tx is not None:
                    with contextlib.suppress(psycopg.Error):
                        open_tx.execute("ROLLBACK")
                if next_fetch is not None:  # a read-ahead of the next batch was in flight: release it
                    with contextlib.suppress(BaseException):
                        if next_fetch.result() is not None:  # submitted in batch k's turn, before k += 1
                            conns[(k + 1) % len(conns)].execute("ROLLBACK")
                if pending is not None:
                    with contextlib.suppress(BaseException):
                        self._settle(pending)
                raise
            finally:
                halt_pass.set()
        return reason

    def _guarded_pass(self, worker: int, lo: Any, hi: Any, only: frozenset[Any] | None = None) -> str | None:
        try:
            return self._pass(worker, lo, hi, only)
        except KeyUnavailable as e:
            self._fail(e, STOP_KEY_UNAVAILABLE, worker)
            return STOP_KEY_UNAVAILABLE
        except DatabaseError as e:
            self._fail(e, STOP_DB_ERROR, worker)
            return STOP_DB_ERROR
        except ThrottleCritical as e:  # fail-safe stop between batches (exit 4)
            self._fail(e, STOP_THROTTLE_CRITICAL, worker)
            return STOP_THROTTLE_CRITICAL
        except psycopg.Error as e:
            err = DatabaseError(f"target {self.target.name}: batch rolled back ({describe_db_error(e)})")
            self._fail(err, STOP_DB_ERROR, worker)
            return STOP_DB_ERROR

    def _fail(self, exc: BaseException, reason: str, worker: int) -> None:
        with self.tally.lock:
            if self.tally.error is None:
                self.tally.error = exc
        self._stop_target.set()
        log_event("batch_failed", level=40, run_id=self.options.run_id or None, target=self.target.name,
                  worker=worker, reason=reason, error=str(exc))

    # -- the drain -------------------------------------------------------------------------------

    def run(self) -> DrainResult:
        opts = self.options
        name = self.target.name
        started = time.perf_counter()
        result = DrainResult(name, self.scheme.current_key, dry_run=opts.dry_run)
        try:
            with raw_connection(self.engine) as conn:
                if opts.dry_run:
                    conn.execute("SET default_transaction_read_only = on")
                result.backlog_before = opts.planned_backlog or self.count_backlog(conn)
                bounds = (self._range_bounds(conn, opts.workers, result.backlog_before)
                          if opts.workers > 1 and result.backlog_before else [])
        except (psycopg.Error, DatabaseError) as e:
            result.stopped, result.retryable = STOP_DB_ERROR, True
            result.error = str(e) if isinstance(e, DatabaseError) else f"target {name}: {describe_db_error(e)}"
            return result
        log_event("target_started", run_id=opts.run_id or None, target=name, current_key=self.scheme.current_key,
                  backlog=result.backlog_before, workers=len(bounds) + 1, dry_run=opts.dry_run or None)

        reason: str | None = None
        remaining: int | None = None  # the backlog as counted after the last batch, if it was
        if result.backlog_before:
            lo, hi = opts.id_range
            ranges = list(zip([lo, *bounds], [*bounds, hi]))
            if len(ranges) == 1:
                reason = self._guarded_pass(0, lo, hi)
            else:
                with ThreadPoolExecutor(max_workers=len(ranges), thread_name_prefix=f"drain-{name}") as ex:
                    # Each worker runs in a copy of the caller's context, so that an orchestrator's
                    # run context (and with it the run's log handler) reaches the worker threads.
                    futures = [ex.submit(contextvars.copy_context().run, self._guarded_pass, i, a, b)
                               for i, (a, b) in enumerate(ranges)]
                    reason = _first_reason([f.result() for f in futures])
            # Sweep from the start: SKIP LOCKED passed over rows that a live transaction held.
            sweeps = 0
            while reason is None and not self._locks and not opts.dry_run and sweeps < MAX_SWEEPS:
                # Compare-and-swap: only the rows an application held locked at the write are tried
                # again (a conflict is left as it is, for the next run to read afresh).
                held = self.tally.take_held()
                if not held:
                    break
                before = self.tally.reencrypted
                sweeps += 1
                reason = self._guarded_pass(0, lo, hi, held)
                if self.tally.reencrypted == before:
                    break  # still locked by someone else: the next run takes them
            while reason is None and self._locks and sweeps < MAX_SWEEPS:
                with raw_connection(self.engine) as conn:
                    left, unfailed = self._count_left(conn, self.tally.failed_ids())
                remaining = left  # the backlog now, unless a sweep moves something
                if not unfailed:
                    break
                before = self.tally.reencrypted
                sweeps += 1
                reason = self._guarded_pass(0, lo, hi)
                if self.tally.reencrypted != before:
                    remaining = None
                else:
                    break  # still locked by someone else: the next run takes them
        self._collect(result, reason)
        if opts.dry_run:
            result.backlog_remaining = result.backlog_before - result.reencrypted
        else:
            self._finish(result, remaining)
        result.duration_ms = (time.perf_counter() - started) * 1000
        log_event("target_completed", run_id=opts.run_id or None, target=name, reencrypted=result.reencrypted,
                  failed=len(result.failed), conflicts=result.conflicts or None, unknown=result.unknown or None,
                  unknown_key=result.unknown_key or None, legacy_left=result.legacy_left or None,
                  batches=result.batches, backlog_remaining=result.backlog_remaining, stopped=result.stopped,
                  duration_ms=round(result.duration_ms, 1), dry_run=opts.dry_run or None)
        return result

    def _collect(self, result: DrainResult, reason: str | None) -> None:
        tally = self.tally
        result.reencrypted = tally.reencrypted
        result.conflicts = tally.conflicts
        result.batches = tally.batches
        result.counts = dict(tally.counts)
        result.conflicts_by_tenant = dict(tally.conflicts_by_tenant)
        result.failed = sorted(tally.failed.values(), key=lambda f: (natural_id_order(f.id), f.reason))
        result.sample_ids = list(dict.fromkeys(tally.sample))
        result.stopped = reason
        if tally.error is not None:
            result.error = str(tally.error)
            result.retryable = bool(getattr(tally.error, "retryable", isinstance(tally.error, DatabaseError)))

    def _finish(self, result: DrainResult, remaining: int | None = None) -> None:
        """Make the batches durable, recount the backlog (unless ``remaining`` was counted after the
        last batch), record CONFLICT counts for the gate."""
        reached = False
        try:
            with raw_connection(self.engine) as conn:
                if result.reencrypted:
                    # Batches commit with synchronous_commit = off: one synchronous commit flushes the
                    # WAL behind every one of them, so a crash cannot undo what this drain reports.
                    force_flush(conn)
                result.backlog_remaining = self.count_backlog(conn) if remaining is None else remaining
                reached = True
                if self.scheme.guard == "cas":
                    try:
                        # A shard (an id range) adds its conflicts and clears nothing: its siblings'
                        # are not its own (record_run_conflicts replaces them once all have ended).
                        record_conflicts(conn, self.target.name, result.conflicts_by_tenant,
                                         tenant_scope=self.options.tenant, complete=result.stopped is None,
                                         run_id=self.options.run_id, shard=self.options.id_range != (None, None))
                    except StateError as e:
                        result.state_error = str(e)
        except (psycopg.Error, DatabaseError) as e:
            # Without the barrier the last batches may not be on disk yet: the run must not
            # report success (a gate opened on it could be undone by a crash).
            if not reached:
                result.backlog_remaining = result.backlog_before - result.reencrypted
            if result.stopped is None:
                result.stopped, result.retryable = STOP_DB_ERROR, True
                result.error = (str(e) if isinstance(e, DatabaseError) else
                                f"target {self.target.name}: could not confirm the batches are durable "
                                f"({describe_db_error(e)})")
        if self.scheme.guard == "cas" and not reached:
            result.state_error = "the CONFLICT counts could not be recorded: the database was unreachable"
        if result.state_error is not None:
            # Fail closed: a gate that cannot see this run's conflicts must not open on its word.
            result.error = result.error or f"target {self.target.name}: {result.state_error}"
            log_event("state_not_saved", level=40, run_id=self.options.run_id or None, target=self.target.name,
                      error=result.state_error)


@dataclass(frozen=True)
class Shard:
    """One id range ``(lo, hi]`` of a target's backlog (None: open end) and its backlog in rows:
    counted when ``exact``, else estimated from a page sample."""

    id_range: tuple[Any, Any]
    rows: int
    exact: bool = True


def split_backlog(engine: sa.Engine, scheme: Scheme, options: DrainOptions, shards: int) -> list[Shard]:
    """The stale, in-scope ids of a target as at most ``shards`` ranges ``(lo, hi]`` of similar row
    counts (quantiles of the id over the stale rows), each with its backlog; the outer ends are open,
    so rows that turn stale later still fall in a shard. One range when there is little or nothing to do.

    Cheap however big the table: when it is big (over 2 x SAMPLE_ROWS by the planner's estimate of
    its rows), the quantiles come from a sample of its pages (``Drain._sampled_bounds``) and each
    shard's backlog is estimated from the sample, not counted: a counting scan of a huge table here
    would keep every worker waiting. (Counting each shard's range instead is no cheaper: with
    random UUID ids, one range's rows lie on nearly every page.) What a shard leaves is counted
    when it ends. A smaller table's stale ids are sorted whole and every range counted exactly, in
    one scan each.
    Adjacent ranges are then merged until each holds at least MIN_BATCHES_PER_SHARD batches.
    """
    drain = Drain(engine, scheme, options)
    try:
        with raw_connection(engine) as conn:
            if options.dry_run:
                conn.execute("SET default_transaction_read_only = on")
            bounds, estimated = (drain._sampled_bounds(conn, shards, drain._estimated_rows(conn)) if shards > 1
                                 else ([], None))
            if not bounds:
                return [Shard((None, None), drain.count_backlog(conn))]
            if estimated is None:
                counts = drain._count_ranges(conn, bounds)
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


def _walk_the_range(conn: psycopg.Connection[Any], range_conditions: Sequence[sql.Composable]) -> None:
    """In the open transaction: a count over part of the ids (a shard) walks the primary key over
    that part, never the whole table. The planner would scan the whole table for a shard of a
    quarter or an eighth of the ids, so that N shards would each read the whole table; by the index,
    a shard's count costs in proportion to the shard, less than its drain's own reads."""
    if range_conditions:
        conn.execute("SET LOCAL enable_seqscan = off")


_heap_lock = threading.Lock()
_heap_holders = 0  # drains running in this process while the long-lived heap is frozen by us


@contextlib.contextmanager
def long_lived_heap_frozen() -> Iterator[None]:
    """While drains run, keep the process's long-lived objects out of the garbage collector's full
    collections (``gc.freeze``), and hand them back when the last drain of the process ends.

    A batch's rows live long enough to be promoted to the oldest generation, so every few batches
    Python runs a full collection, which walks every object of the process: in a Prefect flow or
    a Dask worker, hundreds of thousands of imported objects each time (measured here: about 1 us
    of Python per row re-encrypted, 10%). Frozen objects are only skipped by the collector, never
    freed or changed. A process that froze its heap itself (``gc.get_freeze_count()``) is left as it is.
    """
    global _heap_holders
    with _heap_lock:
        ours = _heap_holders > 0 or gc.get_freeze_count() == 0
        if ours:
            if _heap_holders == 0:
                gc.freeze()
            _heap_holders += 1
    try:
        yield
    finally:
        if ours:
            with _heap_lock:
                _heap_holders -= 1
                if _heap_holders == 0:
                    gc.unfreeze()


def stop_reason(options: DrainOptions, target_stopped: threading.Event | None = None) -> str | None:
    """Why a drain must stop before its next batch, or None: checked between batches only."""
    if options.stop.is_set():
        return STOP_CANCELLED
    if target_stopped is not None and target_stopped.is_set():
        return STOP_KEY_UNAVAILABLE
    if options.deadline is not None and time.monotonic() >= options.deadline:
        return STOP_DEADLINE
    return None


def prepare_session(conn: psycopg.Connection[Any], dry_run: bool) -> None:
    """Session settings of a drain connection (reset when it goes back to the pool)."""
    conn.execute("SET application_name = 'pinrotate'")
    # Keep each batch on the primary key: on small tables the planner may otherwise hash-join
    # the batch against a sequential scan of the whole table.
    conn.execute("SET enable_hashjoin = off")
    conn.execute("SET enable_mergejoin = off")
    if dry_run:
        conn.execute("SET default_transaction_read_only = on")
    else:
        # A commit lost in a crash only leaves its rows on the old key, which is still in the
        # keyring: the next run takes them again. So batches need not wait for each WAL flush;
        # the drain ends with durability.force_flush() before it reports.
        conn.execute("SET synchronous_commit = off")


def _feeds_sizer(throttle: Throttle, started: float, rows: int) -> Callable[[Future[_Outcome]], None]:
    """A done-callback telling the throttle how long a committed batch held its locks."""
    def done(future: Future[_Outcome]) -> None:
        if not future.cancelled() and future.exception() is None:
            throttle.batch_done(time.perf_counter() - started, rows)
    return done


def _first_reason(reasons: Sequence[str | None]) -> str | None:
    order = [STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL, STOP_CANCELLED, STOP_DEADLINE]
    present = [r for r in reasons if r]
    return min(present, key=order.index) if present else None


def drain_target(engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> DrainResult:
    """Drain one target through its scheme (``schemes.build_scheme``)."""
    with long_lived_heap_frozen():
        return Drain(engine, scheme, options).run()
