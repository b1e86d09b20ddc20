"""``run`` (and ``--dry-run``) on MySQL / MariaDB (contract §5), every scheme the room can write
by compare-and-swap (there is no ``xmin``): ``aesgcm``, ``fpc1`` and ``vault-transit`` (its
values rewrapped by Transit in the plan, outside the batch's transaction; a value the application
changed meanwhile is left for the next run, as on PostgreSQL).

Per target, in id order (keyset batches of ``job.batch_size`` in-scope rows, read without locks),
the scheme plans each batch (every new value verified by decrypting it before it is planned); the
write is one transaction per batch (``batch_transaction``: READ COMMITTED, the session's
``innodb_lock_wait_timeout`` from ``job.lock_timeout``) through the room's ``MySqlCasGuard``: rows
the application holds are skipped (``SKIP LOCKED``, never waited on), a row whose values are no
longer the ones read is not written (CONFLICT, exact bytes), ``ON UPDATE CURRENT_TIMESTAMP``
columns keep their value, and what the server stored is read back and compared before COMMIT (a
difference rolls the batch back and stops the target, exit 4). ``fpc1`` first decrypts every
in-scope value once (the pre-pass of ``drain.fpc1_precheck``): a key any value of which fails is
held back for the whole run. ``job.single_instance`` takes ``GET_LOCK`` (server-wide).

Before anything is written, each key's check value is compared with the one recorded in
``pinrotate.key_checks`` (recorded where none is; a dry run only compares): other material under a
recorded key id is refused, exit 2. After each ``fpc1`` target, its CONFLICTs are recorded in
``pinrotate.conflicts`` for the gate (``mysql_bookkeeping``; a failure to record is exit 4).

Not yet on MySQL (said in the report's notes): the run does not go through the Prefect flow, no
throttle, no parallel workers, and the report's gate section says to run ``gate --retire``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import pymysql

from .config import Settings, TargetSettings
from .conflicts import StateError
from .db import database_url, make_engine
from .drain.fpc1_precheck import HoldsFailingKeys
from .drain.results import STOP_DB_ERROR, STOP_DEADLINE, DrainResult
from .engines.mysql import connect as mysql_connect
from .engines.mysql.connect import MySqlConnection
from .engines.mysql.guard import CasRow, MySqlCasGuard, batch_transaction
from .engines.mysql.operations import OPERATIONS as ops
from .engines.mysql.signals import ADVISORY_LOCK
from .errors import ConfigError, DatabaseError, RefusedToStart, TargetBlocked
from .gate.verdict import held_keys
from .keyring import Keyring
from .mysql_bookkeeping import (
    confirm_key_identity_mysql,
    ensure_conflicts_table_mysql,
    record_drain_conflicts,
    tenant_key,
)
from .mysql_inventory import capacity_blocker, inventory_target, read_list
from .mysql_targets import read_table, resolve_mysql_target
from .rotation import LOCK_NAME, RunReport, apply_key_policy, check_start, open_run
from .schemes.base import DECRYPT_FAILED, FailedRow, Scheme
from .schemes.registry import build_scheme
from .schemes.transit import PREFIX as TRANSIT_PREFIX
from .schemes.transit import TRANSIT_VALUE_PATTERN
from .scope_text import scope_condition

ALIAS = "t"
GATE_NOT_DECIDED = ("not decided by a run on MySQL / MariaDB yet: run gate --retire KEY (one snapshot of the "
                    "whole server) before destroying it")
WRITABLE = ("aesgcm", "fpc1", "vault-transit")
# Above any version Transit writes (at most 10 digits): the lowest version of a row with no Transit value.
NO_VERSION = 99_999_999_999
NOT_RECORDED = "on MySQL / MariaDB this run runs without the Prefect flow, throttle or parallel workers (issue 32)"


def mysql_run(settings: Settings, *, target_names: Sequence[str] = (), dry_run: bool = False,
              expected_key: str | None = None, tenant: str | None = None) -> RunReport:
    engine = make_engine(database_url(settings), pool_size=2)
    ctx = open_run(settings, target_names=target_names, dry_run=dry_run, expected_key=expected_key, tenant=tenant,
                   engine=engine, create_keyring=not dry_run)
    try:
        keyring = ctx.provider.load_keyring()
        apply_key_policy(ctx, keyring)
        check_start(ctx, keyring)  # --expected-key-version, fpc1's write_versioned: exit 2, nothing touched
        report = RunReport(ctx.run_id or str(uuid.uuid4()), keyring.current, dry_run)
        started = time.monotonic()
        with mysql_connect.raw_connection(engine) as conn:
            schemes = _resolve_all(conn, ctx.settings, ctx.targets, keyring, ctx.provider, tenant=tenant)
            # Before anything is written (and once no target refuses the start): each key id is the key
            # recorded for it, recorded where nothing is (a dry run only compares).
            confirm_key_identity_mysql(conn, ctx.settings, keyring, ctx.provider, record=not dry_run,
                                       run_id=report.run_id)
            if not dry_run and any(s.guard == "cas" for s in schemes.values()):
                try:  # where the run records its CONFLICTs for the gate, made before the first write
                    ensure_conflicts_table_mysql(conn)
                except StateError as e:
                    raise RefusedToStart(f"{e}; nothing was touched") from None
            with ADVISORY_LOCK.held(conn, LOCK_NAME) as held:
                if ctx.settings.job.single_instance and not held:
                    report.skipped = f"another run holds the lock {LOCK_NAME}"
                    return report
                for t in ctx.targets:
                    report.targets[t.name] = drain_target(conn, ctx.settings, schemes[t.name], keyring,
                                                          dry_run=dry_run, tenant=tenant, started=started)
                    if not dry_run:  # fpc1: its CONFLICTs, for every later inventory and gate
                        record_drain_conflicts(conn, schemes[t.name], report.targets[t.name], tenant=tenant,
                                               run_id=report.run_id)
        # Never more open than gate --retire: not decided here, so closed, saying why.
        report.gate = {key: {"open": False, "blocking": {}, "reason": GATE_NOT_DECIDED}
                       for key in held_keys(keyring) if key != keyring.current}
        report.duration_ms = (time.monotonic() - started) * 1000
        return report
    finally:
        ctx.close()


def _resolve_all(conn: MySqlConnection, settings: Settings, targets: Sequence[TargetSettings], keyring: Keyring,
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


def stale_where(scheme: Scheme, tenant: str | None) -> str:
    """The rows a run may write: in scope and, where the row names its key (``aesgcm``, and
    ``vault-transit`` with a key-version column), on an older one (``<``: never a row on a newer
    key, never a NULL version), as the scheme's ``stale_condition`` says on PostgreSQL;
    ``vault-transit`` without one: the lowest ``vault:v<N>:`` version among the row's values.
    ``fpc1`` values are decided one by one by the plan."""
    t = scheme.target.settings
    kv = scheme.target.key_version
    scope = scope_condition(t, tenant, ops, ALIAS)
    if t.format == "fpc1":
        return scope
    if kv is not None:
        return f"({scope} AND {ops.column(kv.name, ALIAS)} < {int(scheme.current_key)})"
    if t.format == "vault-transit":
        return f"({scope} AND {transit_lowest_version(scheme)} < {int(scheme.current_key)})"
    return scope


def transit_version(column: str) -> str:
    """The version ``N`` a stored value names when the whole value is ``vault:v<N>:<base64>``
    (``TRANSIT_VALUE_PATTERN``, exact bytes), else NULL: ``transit.version_sql`` in MySQL."""
    col = ops.column(column, ALIAS)
    return (f"(CASE WHEN {ops.regex_match(col, ops.text_literal(TRANSIT_VALUE_PATTERN))}"
            f" THEN CAST(SUBSTRING_INDEX(SUBSTRING({ops.text_of(col)}, {len(TRANSIT_PREFIX) + 1}), ':', 1)"
            " AS UNSIGNED) END)")


def transit_lowest_version(scheme: Scheme) -> str:
    """The lowest version among a row's values; ``NO_VERSION`` when none is a Transit value (MySQL's
    LEAST is NULL as soon as one argument is, where PostgreSQL's skips NULLs)."""
    parts = [f"COALESCE({transit_version(c.name)}, {NO_VERSION})" for c in scheme.target.columns]
    return parts[0] if len(parts) == 1 else f"LEAST({', '.join(parts)})"


def _select(scheme: Scheme, tenant: str | None, lo: Any, size: int) -> tuple[str, tuple[Any, ...]]:
    t = scheme.target.settings
    idcol = ops.column(t.id, ALIAS)
    conds, params = ops.keyset(idcol, lo, None)
    statement = ops.next_batch([idcol, *read_list(scheme)], ops.relation(t.schema_name, t.table_name, ALIAS),
                               [stale_where(scheme, tenant), *conds], idcol)
    return statement, (*params, size)


def _rows(conn: MySqlConnection, scheme: Scheme, tenant: str | None, size: int) -> Any:
    """Every in-scope row in id order, batch by batch (each a list of ``(id, *read_list)``)."""
    lo = None
    while True:
        statement, params = _select(scheme, tenant, lo, size)
        with conn.cursor() as cur:
            cur.execute(statement, params)
            rows = [tuple(r) for r in cur.fetchall()]
        if not rows:
            return
        lo = rows[-1][0]
        yield rows


def _precheck(conn: MySqlConnection, scheme: HoldsFailingKeys, base: Scheme, tenant: str | None,
              size: int, result: DrainResult) -> None:
    """fpc1: decrypt every in-scope value once; hold back each key one of whose values fails."""
    failing: dict[str, int] = {}
    for rows in _rows(conn, base, tenant, size):
        for row in rows:
            found = scheme.failing_values(row[2:])
            for _, key in found:
                failing[key] = failing.get(key, 0) + 1
            if found:
                result.failed.append(FailedRow(result.target, str(row[0]), tuple(label for label, _ in found),
                                               DECRYPT_FAILED))
    if failing:
        scheme.hold(failing)


def drain_target(conn: MySqlConnection, settings: Settings, scheme: Scheme, keyring: Keyring, *, dry_run: bool,
                 tenant: str | None, started: float) -> DrainResult:
    t = scheme.target.settings
    result = DrainResult(t.name, keyring.current, dry_run=dry_run)
    began = time.monotonic()
    size = settings.job.batch_size
    kv = scheme.target.key_version if t.format != "fpc1" else None
    ciphers = [c.name for c in scheme.target.columns]
    table = read_table(conn, t, writing=not dry_run)
    guard = MySqlCasGuard(table, t.id, [*ciphers, *([kv.name] if kv else [])],
                          stale_where=stale_where(scheme, tenant))
    if isinstance(scheme, HoldsFailingKeys):
        _precheck(conn, scheme, scheme, tenant, size, result)
    known_failed = {f.id for f in result.failed}
    try:
        for rows in _rows(conn, scheme, tenant, size):
            plan = scheme.plan(rows, known_failed)
            for f in plan.failed:
                if f.id not in known_failed:
                    result.failed.append(f)
                    known_failed.add(f.id)
            for name, n in plan.counts.items():
                result.counts[name] = result.counts.get(name, 0) + n
            if dry_run:
                result.reencrypted += plan.planned
                continue
            if not plan.writes:
                continue
            read = {row[0]: row for row in rows}
            new: dict[Any, list[Any]] = {}
            weight: dict[Any, int] = {}
            for w in plan.writes:
                for j, row_id in enumerate(w.ids):
                    values = new.setdefault(row_id, list(read[row_id][2:]))
                    for k, column in enumerate(w.columns):
                        values[column] = w.new[k][j]
                    weight[row_id] = weight.get(row_id, 0) + (w.weights[j] if j < len(w.weights) else 1)
            current = [int(keyring.current)] if kv else []
            cas = [CasRow(row_id, (*read[row_id][2:], *([read[row_id][1]] if kv else [])), (*values, *current))
                   for row_id, values in new.items()]
            with batch_transaction(conn, settings.job.lock_timeout):
                outcome = guard.write(conn, cas)
                if outcome.mismatched:
                    raise _Mismatch(len(outcome.mismatched))
            result.batches += 1
            result.reencrypted += sum(weight[i] for i in outcome.written)
            if t.format == "fpc1":  # CONFLICT: an fpc1 value changed between read and write (contract §6)
                for row_id in outcome.changed:  # values, per tenant (read_list: id, tenant, values...)
                    by = tenant_key(read[row_id][1])
                    result.conflicts += weight[row_id]
                    result.conflicts_by_tenant[by] = result.conflicts_by_tenant.get(by, 0) + weight[row_id]
            # aesgcm: a row the application changed meanwhile is left for the next run, as on PostgreSQL
            if settings.job.inter_batch_delay:
                time.sleep(settings.job.inter_batch_delay)
            if time.monotonic() - started > settings.job.max_run_duration:
                result.notes.append("stopped at job.max_run_duration; the next run resumes")
                result.stopped = STOP_DEADLINE  # saw part of the target: clears no earlier CONFLICT
                break
    except _Mismatch as e:
        result.stopped, result.error = STOP_DB_ERROR, (f"{e.rows} row(s) read back differently from what was "
                                                       "written (a trigger or a truncation?): the batch was rolled back")
    except pymysql.err.MySQLError as e:
        result.stopped, result.error = STOP_DB_ERROR, f"the batch was rolled back ({mysql_connect.describe_db_error(e)})"
    after = inventory_target(conn, scheme, tenant=tenant)
    result.backlog_remaining = (after.counts["HISTORICAL"] + after.counts["LEGACY"]) if not dry_run else \
        max(after.counts["HISTORICAL"] + after.counts["LEGACY"] - result.reencrypted, 0)
    result.notes.append(NOT_RECORDED)
    result.duration_ms = (time.monotonic() - began) * 1000
    return result


class _Mismatch(Exception):
    def __init__(self, rows: int) -> None:
        super().__init__(rows)
        self.rows = rows
