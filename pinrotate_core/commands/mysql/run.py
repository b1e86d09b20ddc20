"""``run`` (and ``--dry-run``) on MySQL / MariaDB (contract §5), every scheme the room can write
by compare-and-swap (there is no ``xmin``): ``aesgcm``, ``fpc1`` and ``vault-transit`` (its
values rewrapped by Transit in the plan, outside the batch's transaction; a value the application
changed meanwhile is left for the next run, as on PostgreSQL).

The run is the Prefect flow's, as on PostgreSQL: ``rotation`` asks here for each step of it on a
MySQL / MariaDB URL (``resolve_targets``, ``.selection.plan_shards``, ``drain``, ``verify_sample``; the gate is
``.gate.run_gate``), and these return the same types as the PostgreSQL steps.

Per target or shard (ids in ``(lo, hi]``), in id order (keyset batches of the throttle's batch size
or ``job.batch_size`` in-scope rows, read without locks), the scheme plans each batch (every new
value verified by decrypting it before it is planned); the write is one transaction per batch
(``batch_transaction``: READ COMMITTED, the session's ``innodb_lock_wait_timeout`` from
``job.lock_timeout``) through the room's ``MySqlCasGuard``: rows the application holds are skipped
(``SKIP LOCKED``, never waited on), a row whose values are no longer the ones read is not written
(CONFLICT, exact bytes; ``fpc1``: unless another run moved them meanwhile, same plaintext on the
active key, which is done, ``settled_elsewhere``, as on PostgreSQL), ``ON UPDATE CURRENT_TIMESTAMP`` columns keep their value, and what the
server stored is read back and compared before COMMIT (a row that stored something else, a
trigger's doing, rolls the batch back and is FAILED, ``not_stored``: the batch is written again
without it, as on PostgreSQL); a connection lost during the COMMIT itself is an unknown outcome,
never reported as rolled back (``CommitUnknown``), and the backlog left is recounted on a connection
of its own. Between batches, never holding a row: the stop (a cancellation, SIGTERM, Ctrl-C), the
deadline, the throttle (``throttle.mysql``: ``Threads_running``, replica lag, the operator's
Variable). ``fpc1`` first decrypts every stale value of the whole target once, every tenant and
every shard's ids (the pre-pass of ``drain.fpc1_precheck``): a key any value of which fails is
held back for the whole run.

Which rows are read, and the shards' plan: ``.selection``.

Bookkeeping (``.bookkeeping``, in the server's ``pinrotate`` database): before anything is
written, ``rotation.read_current_key`` compares each key's check value with the one recorded in
``pinrotate.key_checks`` (recorded where none is; a dry run only compares; other material under a
recorded key id is refused, exit 2) and ``rotation.resolve_all`` creates ``pinrotate.conflicts``
for a run with an ``fpc1`` target. After each ``fpc1`` drain its CONFLICTs are recorded there for
the gate (a shard adds its own and clears nothing; ``rotation.record_run_conflicts`` records the
run's total once every shard has ended); a failure to record is exit 4.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pymysql
import sqlalchemy as sa

from ... import tracing
from ...config import Settings, TargetSettings
from ...conflicts import StateError
from ...drain.fpc1_precheck import HoldsFailingKeys
from ...drain.options import DrainOptions, stop_reason
from ...drain.results import (
    STOP_DB_ERROR,
    STOP_KEY_UNAVAILABLE,
    STOP_THROTTLE_CRITICAL,
    BatchEvent,
    CommitUnknown,
    DrainResult,
    commit_unknown_note,
    natural_id_order,
)
from ...drain.run import MAX_SWEEPS
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql.connect import MySqlConnection
from ...engines.mysql.guard import CasOutcome, CasRow, CommitOutcomeUnknown, MySqlCasGuard, batch_transaction
from ...engines.mysql.operations import OPERATIONS as ops
from ...engines.mysql.signals import drain_session
from ...errors import ConfigError, DatabaseError, KeyUnavailable, TargetBlocked, ThrottleCritical
from ...keyring import Keyring
from ...log import log_event
from ...schemes.base import DECRYPT_FAILED, NOT_STORED, FailedRow, Scheme
from ...schemes.fpc1 import Fpc1Scheme
from ...schemes.registry import build_scheme
from ..base import count_read_back
from .bookkeeping import record_conflicts_mysql, tenant_key
from .inventory import capacity_blocker
from .selection import ALIAS, count_backlog, read_batch, rows_in_scope, stale_rows, stale_where
from .targets import read_table, resolve_mysql_target

WRITABLE = ("aesgcm", "fpc1", "vault-transit")
SAMPLE_IDS = 64  # rows a drain keeps for verify to read back


def resolve_targets(conn: MySqlConnection, settings: Settings, targets: Sequence[TargetSettings], keyring: Keyring,
                    provider: object, *, tenant: str | None) -> dict[str, Scheme]:
    """Every target resolved and its scheme bound before anything is written: one blocked target
    stops the start (exit 2, nothing touched)."""
    schemes: dict[str, Scheme] = {}
    try:
        for t in targets:
            if t.format not in WRITABLE:
                raise TargetBlocked(t.name, f"format {t.format} cannot run on MySQL / MariaDB yet (issue 32)")
            resolved = resolve_mysql_target(conn, t, writing=True)
            scheme = build_scheme(resolved, keyring, settings.keys, provider)
            reason = capacity_blocker(conn, scheme, tenant)
            if reason is not None:
                raise TargetBlocked(t.name, reason)
            schemes[t.name] = scheme
    except TargetBlocked as e:
        raise ConfigError(f"{e}; nothing was touched") from None
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"cannot resolve the targets ({mysql_connect.describe_db_error(e)})") from None
    return schemes


def _precheck(conn: MySqlConnection, scheme: HoldsFailingKeys, base: Scheme, result: DrainResult,
              id_range: tuple[Any, Any], run_id: str = "") -> None:
    """fpc1: decrypt every stale value of the WHOLE target once (every tenant, every shard's ids, as
    ``drain.fpc1_precheck`` does on PostgreSQL): hold back each key one of whose values fails, and
    list the failing rows of this drain's own ``id_range``. A shard or a ``--tenant`` run whose own
    values all pass must still rewrite nothing under a key that fails elsewhere: the wrong key's
    values that happen to pass the padding would be rewritten as garbage."""
    failing: dict[str, int] = {}
    for row in stale_rows(conn, base, id_range):
        found = scheme.failing_values(row[3:])
        for _, key in found:
            failing[key] = failing.get(key, 0) + 1
        if found and row[1]:
            result.failed.append(FailedRow(result.target, str(row[0]), tuple(label for label, _ in found),
                                           DECRYPT_FAILED))
    if failing:
        scheme.hold(failing)
        for key, n in sorted(failing.items()):
            log_event("key_held", level=30, run_id=run_id or None, target=result.target, key=key, failing_values=n)


def drain(engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> DrainResult:
    """Drain one target, or one shard of it (``options.id_range``), as ``drain.drain_target`` does
    on PostgreSQL: backlog, batches (``drain_target``), backlog left, its CONFLICTs recorded
    (``record_conflicts``), the same log lines."""
    t = scheme.target.settings
    result = DrainResult(t.name, scheme.current_key, dry_run=options.dry_run)
    began = time.monotonic()
    reached = False  # the drain's CONFLICTs were recorded, or its recording failed with a reason
    try:
        with mysql_connect.raw_connection(engine) as conn, drain_session(conn):  # known to the row-lock watch
            result.backlog_before = options.planned_backlog or count_backlog(conn, scheme, options.tenant,
                                                                             options.id_range)
            log_event("target_started", run_id=options.run_id or None, target=t.name, shard=options.shard or None,
                      current_key=scheme.current_key, backlog=result.backlog_before, workers=1,
                      dry_run=options.dry_run or None)
            if result.backlog_before:
                drain_target(conn, scheme, options, result)
            with _alive(engine, conn) as live:
                if options.dry_run:
                    result.backlog_remaining = max(result.backlog_before - result.reencrypted, 0)
                else:
                    result.backlog_remaining = count_backlog(live, scheme, options.tenant, options.id_range)
                reached = True
                record_conflicts(live, scheme, result, options)
    except (pymysql.err.MySQLError, DatabaseError) as e:
        if result.stopped is None:
            result.stopped, result.retryable = STOP_DB_ERROR, True
            result.error = (str(e) if isinstance(e, DatabaseError)
                            else f"target {t.name}: {mysql_connect.describe_db_error(e)}")
        if not options.dry_run and not reached:
            result.backlog_remaining = max(result.backlog_before - result.reencrypted, 0)
    if not reached and not options.dry_run and scheme.guard == "cas":
        # Fail closed: a gate that cannot see this drain's CONFLICTs must not open on its word.
        result.state_error = "the CONFLICT counts could not be recorded: the database was unreachable"
    if result.state_error is not None:
        result.error = result.error or f"target {t.name}: {result.state_error}"
        log_event("state_not_saved", level=40, run_id=options.run_id or None, target=t.name,
                  error=result.state_error)
    # The pre-pass lists its rows first: the report lists them in id order, as on PostgreSQL.
    result.failed.sort(key=lambda f: (natural_id_order(f.id), f.reason))
    result.duration_ms = (time.monotonic() - began) * 1000
    log_event("target_completed", run_id=options.run_id or None, target=t.name, shard=options.shard or None,
              reencrypted=result.reencrypted, failed=len(result.failed), conflicts=result.conflicts or None,
              batches=result.batches, backlog_remaining=result.backlog_remaining, stopped=result.stopped,
              duration_ms=round(result.duration_ms, 1), dry_run=options.dry_run or None)
    return result


@contextlib.contextmanager
def _alive(engine: sa.Engine, conn: MySqlConnection) -> Iterator[MySqlConnection]:
    """``conn``, or a connection of its own when ``conn`` was lost (a batch whose COMMIT outcome is
    unknown): what the drain left is counted from the database either way."""
    if conn.open:
        yield conn
        return
    with mysql_connect.raw_connection(engine) as fresh:
        yield fresh


def record_conflicts(conn: MySqlConnection, scheme: Scheme, result: DrainResult, options: DrainOptions) -> None:
    """After a non-dry drain of a ``cas`` target (``fpc1``): its CONFLICTs in ``pinrotate.conflicts``
    for the gate, as ``guard_cas`` records them on PostgreSQL. A shard (an id range) adds its own
    and clears nothing: its siblings' are not its own (``rotation.record_run_conflicts`` records the
    run's total once all have ended). A failure leaves the drain fail-closed (``state_error``: exit 4)."""
    if options.dry_run or scheme.guard != "cas":
        return
    try:
        record_conflicts_mysql(conn, result.target, result.conflicts_by_tenant, tenant_scope=options.tenant,
                               complete=result.stopped is None, run_id=options.run_id,
                               shard=options.id_range != (None, None))
    except StateError as e:
        result.state_error = str(e)


def _wait_for_next_batch(options: DrainOptions, first: bool) -> int:
    """Before a batch, holding no row: the throttle's wait (or ``inter_batch_delay``); the size of
    the next batch."""
    if options.throttle is not None:
        options.throttle.before_batch(options.stop, options.deadline, first=first)
        return options.throttle.batch_size
    if options.inter_batch_delay and not first:
        left = options.inter_batch_delay if options.deadline is None else options.deadline - time.monotonic()
        options.stop.wait(max(0.0, min(options.inter_batch_delay, left)))
    return options.batch_size


def drain_target(conn: MySqlConnection, scheme: Scheme, options: DrainOptions, result: DrainResult) -> None:
    """The batches of one target or shard into ``result``: stops between batches only (the stop,
    the deadline, a fail-closed error)."""
    t = scheme.target.settings
    dry_run, tenant = options.dry_run, options.tenant
    kv = scheme.target.key_version if t.format != "fpc1" else None
    ciphers = [c.name for c in scheme.target.columns]
    table = read_table(conn, t, writing=not dry_run)
    guard = MySqlCasGuard(table, t.id, [*ciphers, *([kv.name] if kv else [])],
                          stale_where=stale_where(scheme, tenant))
    if isinstance(scheme, HoldsFailingKeys):
        _precheck(conn, scheme, scheme, result, options.id_range, options.run_id)
    known_failed = {f.id for f in result.failed}
    lo, hi = options.id_range
    batch_no = 0
    try:
        # A pass over the range, then sweeps of the rows the application held at the write (they may be
        # free by then), while a sweep moves something, as on PostgreSQL (drain.run: MAX_SWEEPS).
        only: list[Any] | None = None
        for sweep in range(MAX_SWEEPS + 1):
            lo, held, moved_before = options.id_range[0], [], result.reencrypted
            while True:
                size = _wait_for_next_batch(options, batch_no == 0)
                reason = stop_reason(options)
                if reason is not None:
                    result.stopped = reason
                    break
                started = time.perf_counter()
                rows = read_batch(conn, scheme, tenant, lo, hi, size, only=only)
                if not rows:
                    break
                lo = rows[-1][0]
                batch_no += 1
                result.batches += 1  # every batch read, written or not, dry or not: as on PostgreSQL
                plan = scheme.plan(rows, known_failed)
                if options.before_write is not None:  # between the batch's read and its write, as on PostgreSQL
                    options.before_write(batch_no, [r[0] for r in rows])
                for f in plan.failed:
                    if f.id not in known_failed:
                        result.failed.append(f)
                        known_failed.add(f.id)
                for name, n in plan.counts.items():
                    result.counts[name] = result.counts.get(name, 0) + n
                conflicts = 0
                if dry_run:
                    moved = plan.planned
                    result.reencrypted += moved
                elif not plan.writes:
                    moved = 0
                else:
                    read = {row[0]: row for row in rows}
                    new: dict[Any, list[Any]] = {}
                    weight: dict[Any, int] = {}
                    written_columns: dict[Any, list[str]] = {}
                    for w in plan.writes:
                        for j, row_id in enumerate(w.ids):
                            values = new.setdefault(row_id, list(read[row_id][2:]))
                            for k, column in enumerate(w.columns):
                                values[column] = w.new[k][j]
                                written_columns.setdefault(row_id, []).append(ciphers[column])
                            weight[row_id] = weight.get(row_id, 0) + (w.weights[j] if j < len(w.weights) else 1)
                    current = [int(scheme.current_key)] if kv else []
                    cas = [CasRow(row_id, (*read[row_id][2:], *([read[row_id][1]] if kv else [])), (*values, *current))
                           for row_id, values in new.items()]
                    # One ``pinrotate.batch`` span per batch transaction (names and counts only; no-op without tracing).
                    with tracing.batch_span(options.run_id, t.name, scheme.current_key, size, batch=batch_no) as span:
                        try:
                            outcome, not_stored = _write_stored(conn, guard, cas, options, t.name)
                        except CommitOutcomeUnknown as e:  # never reported as rolled back
                            raise CommitUnknown(t.name, sum(weight.values()),
                                                mysql_connect.describe_db_error(e.cause)) from None
                        for row_id in not_stored:  # left as it was, whole: FAILED, as on PostgreSQL
                            failed = FailedRow(t.name, str(row_id), tuple(dict.fromkeys(written_columns[row_id])),
                                               NOT_STORED)
                            plan.failed.append(failed)
                            result.failed.append(failed)
                            known_failed.add(failed.id)
                        moved = sum(weight[i] for i in outcome.written)
                        held += outcome.skipped  # held by the application: for the sweep
                        tracing.batch_written(span, moved, len(outcome.changed) if t.format == "fpc1" else 0,
                                              (f.reason for f in plan.failed))
                    result.reencrypted += moved
                    result.sample_ids += outcome.written[:max(0, SAMPLE_IDS - len(result.sample_ids))]
                    if t.format == "fpc1":  # CONFLICT: an fpc1 value changed between read and write (contract §6)
                        settled = _settled_elsewhere(conn, scheme, tenant, read, outcome.changed)
                        for row_id in outcome.changed:  # values, per tenant (read_list: id, tenant, values...)
                            if row_id in settled:  # moved by another run meanwhile: done, not a CONFLICT
                                result.counts["settled_elsewhere"] = (result.counts.get("settled_elsewhere", 0)
                                                                      + weight[row_id])
                                continue
                            by = tenant_key(read[row_id][1])
                            conflicts += weight[row_id]
                            result.conflicts_by_tenant[by] = result.conflicts_by_tenant.get(by, 0) + weight[row_id]
                        result.conflicts += conflicts
                    # aesgcm: a row the application changed meanwhile is left for the next run, as on PostgreSQL
                    if options.throttle is not None:  # read-to-commit time feeds the batch sizer
                        options.throttle.batch_done(time.perf_counter() - started, len(rows))
                _record(options, t.name, batch_no, len(rows), moved, len(plan.failed), conflicts, started)
            if result.stopped is not None or dry_run or not held or (sweep and result.reencrypted == moved_before):
                break
            only = held
    except CommitUnknown as e:  # the connection is gone: drain() recounts the backlog on another
        result.stopped, result.error, result.retryable = STOP_DB_ERROR, str(e), True
        result.notes.append(commit_unknown_note(e.rows))
    except ThrottleCritical as e:  # fail-safe stop between batches (exit 4)
        result.stopped, result.error = STOP_THROTTLE_CRITICAL, str(e)
    except KeyUnavailable as e:
        result.stopped, result.error, result.retryable = STOP_KEY_UNAVAILABLE, str(e), e.retryable
    except DatabaseError as e:
        result.stopped, result.error, result.retryable = STOP_DB_ERROR, str(e), True
    except pymysql.err.MySQLError as e:
        result.stopped, result.retryable = STOP_DB_ERROR, True
        result.error = f"the batch was rolled back ({mysql_connect.describe_db_error(e)})"
    if result.stopped in (STOP_DB_ERROR, STOP_KEY_UNAVAILABLE, STOP_THROTTLE_CRITICAL):
        log_event("batch_failed", level=40, run_id=options.run_id or None, target=t.name, worker=0,
                  reason=result.stopped, error=result.error)


def _settled_elsewhere(conn: MySqlConnection, scheme: Scheme, tenant: str | None, read: dict[Any, tuple[Any, ...]],
                       changed: Sequence[Any]) -> set[Any]:
    """fpc1: the rows not written because they changed since they were read whose values another
    run moved meanwhile (on the active key, the same plaintext, nothing else changed:
    ``Fpc1Scheme.settled``), as ``drain.guard_cas`` settles its misses on PostgreSQL. An
    application's edit, or a row gone or out of scope, stays a CONFLICT."""
    if not changed or not isinstance(scheme, Fpc1Scheme):
        return set()
    columns = scheme.target.columns
    now = rows_in_scope(conn, scheme, tenant, changed)
    return {row_id for row_id, row in now.items()
            if all(n == r or scheme.settled(c, r, n) for c, r, n in zip(columns, read[row_id][2:], row[2:], strict=True))
            and row[2:] != read[row_id][2:]}


def _write_stored(conn: MySqlConnection, guard: MySqlCasGuard, rows: Sequence[CasRow], options: DrainOptions,
                  target: str) -> tuple[CasOutcome, list[Any]]:
    """One batch transaction, committed only when every row written stored exactly the value
    written. A row that stored something else (a BEFORE UPDATE trigger kept or changed it, a lax
    server cut it) rolls the batch back, and the batch is written again without it (each try
    leaves out at least one more row): the outcome of the try that committed, and the ids left out."""
    left_out: list[Any] = []
    while True:
        try:
            with batch_transaction(conn, options.lock_timeout, options.statement_timeout, options.idle_timeout):
                outcome = guard.write(conn, rows)
                if outcome.mismatched:
                    raise _Mismatch(outcome.mismatched)
            return outcome, left_out
        except _Mismatch as e:  # rolled back
            dropped = set(e.ids)
            left_out += e.ids
            rows = [r for r in rows if r.row_id not in dropped]
            log_event("batch_write_retried", level=30, run_id=options.run_id or None, target=target,
                      reason="the database stored another value than the one written", rows=len(e.ids))


def _record(options: DrainOptions, target: str, batch_no: int, rows: int, moved: int, failed: int, conflicts: int,
            started: float) -> None:
    """A committed (or, in a dry run, computed) batch: its log line and the progress callback, as
    the PostgreSQL pipeline tells them."""
    event = BatchEvent(target, 0, batch_no, rows, moved, failed, (time.perf_counter() - started) * 1000,
                       options.dry_run, conflicts=conflicts)
    log_event("batch_processed", run_id=options.run_id or None, target=target, shard=options.shard or None,
              worker=0, batch=batch_no, rows=rows, reencrypted=moved, failed=failed, conflicts=conflicts or None,
              duration_ms=round(event.duration_ms, 1), dry_run=options.dry_run or None)
    if options.on_batch is not None:
        options.on_batch(event)


def verify_sample(engine: sa.Engine, scheme: Scheme, ids: Sequence[Any]) -> tuple[int, int]:
    """Re-read rows this run committed and decrypt every value (as ``inventory --deep`` does)."""
    t = scheme.target.settings
    idcol = ops.column(t.id, ALIAS)
    statement = (f"SELECT {idcol}, {', '.join(scheme.read_list(ops, ALIAS))} FROM {ops.relation(t.schema_name, t.table_name, ALIAS)}"
                 f" WHERE {idcol} IN ({', '.join(['%s'] * len(ids))})")
    try:
        with mysql_connect.raw_connection(engine) as conn, conn.cursor() as cur:
            cur.execute(statement, tuple(ids))
            rows = list(cur.fetchall())
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"target {t.name}: cannot read the rows to verify "
                            f"({mysql_connect.describe_db_error(e)})") from None
    return count_read_back(scheme, rows)


class _Mismatch(Exception):
    """Rows whose stored value is not the one written: the batch transaction rolls back."""

    def __init__(self, ids: Sequence[Any]) -> None:
        super().__init__(len(ids))
        self.ids = list(ids)
