"""The drain of ``fpc1`` targets: move every stale value (older key id, or legacy) to the active key.

Keyset pagination by id over the rows in scope (tenant, not soft-deleted); each batch is read
WITHOUT row locks, planned by a pure function (every new value decrypted again before use), then
written with compare-and-swap: one set-based UPDATE per column that changes only rows still
holding the value we read. A value the application changed meanwhile is a CONFLICT and is never
overwritten. It never writes a legacy value, any other column, or (in a dry run) anything at all.

Per value, in scope:
- ACTIVE (FPC1 on the active key): skipped, so a run can be repeated.
- HISTORICAL (FPC1 on another key of the keyring) and LEGACY (when ``legacy_read_enabled``):
  re-encrypted. An FPC1 value keeps its algorithm; a legacy value becomes ``AES-GCM``.
- LEGACY with legacy reading off: counted (``legacy_left``), left alone; the run goes on.
- UNKNOWN (not parseable): counted, left alone.
- UNKNOWN_KEY (a key id the keyring lacks; or legacy with no legacy key): left alone and reported
  as a failed row with reason ``unknown_key``, so the run ends fail-closed (exit 4).
- does not decrypt: a failed row with reason ``decrypt_failed`` (exit 4).
Counts (``reencrypted``, ``conflicts``, backlog) are values, like the fpc1 inventory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
import sqlalchemy as sa
from psycopg import sql

from .config import KeysSettings
from .db import describe_db_error, raw_connection
from .drain import (
    STOP_CANCELLED,
    STOP_DB_ERROR,
    STOP_KEY_UNAVAILABLE,
    BatchEvent,
    DrainOptions,
    DrainResult,
    prepare_session,
    stop_reason,
)
from .errors import CiphertextInvalid, ConfigError, DatabaseError, KeyUnavailable, VerificationFailed
from .formats.fpc1 import ALGORITHMS, Algorithm, Fpc1CipherSet, parse_fpc1, replace_json_values
from .formats.legacy import LegacyFormat, check_legacy_format
from .inventory_fpc1 import (
    STALE,
    ValueClass,
    classify_value,
    column_as_text,
    scope_condition,
    values_of_column,
)
from .keyring import Keyring
from .log import log_event
from .reencrypt import DECRYPT_FAILED, FailedRow
from .state import NO_TENANT, StateError, database_identity, record_conflicts
from .targets import Column, ResolvedTarget, begin_writing_batch

UNKNOWN_KEY: Final = "unknown_key"
JSON_REWRITE_REFUSED: Final = "json_rewrite_refused"
SCAN_ROWS: Final = 5000

# Rewrites one stale value to the active key (verified); CiphertextInvalid if it does not decrypt.
Rewrite = Callable[[str, ValueClass], str]
# Test and instrumentation hook: (batch number, ids read) after a batch is planned, before its write.
BeforeWrite = Callable[[int, Sequence[Any]], None]


@dataclass
class Fpc1DrainResult(DrainResult):
    """A DrainResult with the fpc1 value counts that have no place in the common shape."""

    active: int = 0  # in-scope values already on the active key (skipped)
    unknown: int = 0  # not parseable, left alone
    unknown_key: int = 0  # key id not in the keyring (also in ``failed``, reason unknown_key)
    legacy_left: int = 0  # legacy values not migrated because keys.legacy_read_enabled is false
    conflicts_by_tenant: dict[str, int] = field(default_factory=dict)
    state_error: str | None = None  # the CONFLICT counts could not be saved for the gate

    @property
    def fail_closed(self) -> bool:
        return super().fail_closed or self.state_error is not None


@dataclass(frozen=True)
class Fpc1BatchEvent(BatchEvent):
    conflicts: int = 0


# --- planning: pure, no database ----------------------------------------------------------------


@dataclass
class ColumnWrite:
    """Compare-and-swap rows of one column: id, value read, value to write, tenant, values inside."""

    ids: list[Any] = field(default_factory=list)
    originals: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    tenants: list[str] = field(default_factory=list)
    values: list[int] = field(default_factory=list)


@dataclass
class Fpc1BatchPlan:
    writes: dict[str, ColumnWrite] = field(default_factory=dict)
    failed: list[FailedRow] = field(default_factory=list)
    active: int = 0
    unknown: int = 0
    unknown_key: int = 0
    legacy_left: int = 0
    stale: int = 0

    @property
    def planned(self) -> int:
        """Values this batch would re-encrypt if nobody changed them first."""
        return sum(sum(w.values) for w in self.writes.values())


def plan_fpc1_batch(
    target: str,
    columns: Sequence[tuple[str, tuple[str, ...]]],
    rows: Sequence[Sequence[Any]],
    keyring: Keyring,
    rewrite: Rewrite,
    *,
    legacy_format: LegacyFormat,
    legacy_read_enabled: bool,
) -> Fpc1BatchPlan:
    """Decide every value of ``rows`` = ``(id, tenant, *column texts)``; ``columns`` = (name, json paths).

    Each value is decided alone: in a row with two stale fields one may move and the other fail.
    A JSON column is rewritten once, with every field of it that moves.
    """
    plan = Fpc1BatchPlan()
    can_read_legacy = legacy_read_enabled and keyring.legacy is not None
    for row in rows:
        row_id, tenant = row[0], row[1]
        problems: dict[str, list[str]] = {}
        for (column, paths), text in zip(columns, row[2:]):
            replacements: dict[str | None, str] = {}
            for value_field, stored in values_of_column(column, paths, text):
                if stored is None:
                    plan.unknown += 1
                    continue
                value = classify_value(stored, keyring, legacy_format)
                if value.category == "ACTIVE":
                    plan.active += 1
                    continue
                if value.category == "UNKNOWN":
                    plan.unknown += 1
                    continue
                plan.stale += 1
                if value.category == "LEGACY" and not legacy_read_enabled:
                    plan.legacy_left += 1
                    continue
                if value.category == "UNKNOWN_KEY" or (value.category == "LEGACY" and not can_read_legacy):
                    plan.unknown_key += 1
                    problems.setdefault(UNKNOWN_KEY, []).append(value_field.label)
                    continue
                try:
                    replacements[value_field.path] = rewrite(stored, value)
                except CiphertextInvalid:
                    problems.setdefault(DECRYPT_FAILED, []).append(value_field.label)
                except KeyUnavailable:
                    plan.unknown_key += 1
                    problems.setdefault(UNKNOWN_KEY, []).append(value_field.label)
            if not replacements:
                continue
            assert text is not None
            if not paths:
                new_text = replacements[None]
            else:
                try:
                    new_text = replace_json_values(text, {p: v for p, v in replacements.items() if p is not None})
                except (CiphertextInvalid, LookupError, ConfigError):
                    # e.g. a key on the path occurs twice: which copy the application reads is not ours to guess.
                    problems.setdefault(JSON_REWRITE_REFUSED, []).extend(
                        f"{column}[{p}]" for p in replacements if p is not None)
                    continue
            write = plan.writes.setdefault(column, ColumnWrite())
            write.ids.append(row_id)
            write.originals.append(text)
            write.updated.append(new_text)
            write.tenants.append(NO_TENANT if tenant is None else str(tenant))
            write.values.append(len(replacements))
        for reason, labels in problems.items():
            plan.failed.append(FailedRow(target, str(row_id), tuple(labels), reason))
    return plan


# --- the drain ----------------------------------------------------------------------------------


@dataclass
class _BatchOutcome:
    reencrypted: int = 0
    conflicts: int = 0


class Fpc1Drain:
    """Drain of one ``fpc1`` target (see the module docstring). One sequential keyset pass: with
    no row locks there is nothing to sweep for, and parallel runs stay safe through the CAS."""

    def __init__(self, engine: sa.Engine, target: ResolvedTarget, keyring: Keyring, options: DrainOptions, *,
                 keys: KeysSettings | None = None, before_write: BeforeWrite | None = None) -> None:
        keys = keys or KeysSettings()
        self.engine = engine
        self.target = target
        self.keyring = keyring
        self.options = options
        self.before_write = before_write
        self.legacy_format: LegacyFormat = check_legacy_format(keys.legacy_format)
        self.legacy_read_enabled = keys.legacy_read_enabled
        # Built now: a keyring fpc1 cannot use (bad key length or id) stops the start.
        self._ciphers: dict[Algorithm, Fpc1CipherSet] = {"AES-GCM": self._cipher_set("AES-GCM")}
        t = target.settings
        self._columns = [(c.name, tuple(t.json_paths.get(c.name, ()))) for c in target.columns]
        self._active_prefixes = [f"FPC1:{a}:{keyring.current}:" for a in ALGORITHMS]
        self._update_sql = {c.name: self._update(c) for c in target.columns}
        self._stop_reason: str | None = None

    def _cipher_set(self, algorithm: Algorithm) -> Fpc1CipherSet:
        return Fpc1CipherSet(self.keyring, algorithm=algorithm, legacy_format=self.legacy_format,
                             legacy_read_enabled=self.legacy_read_enabled)

    def rewrite(self, stored: str, value: ValueClass) -> str:
        """``stored`` under the active key, verified; FPC1 keeps its algorithm, legacy becomes AES-GCM."""
        algorithm: Algorithm = parse_fpc1(stored).algorithm if value.category != "LEGACY" else "AES-GCM"
        ciphers = self._ciphers.get(algorithm)
        if ciphers is None:
            try:
                ciphers = self._ciphers[algorithm] = self._cipher_set(algorithm)
            except ConfigError as e:  # e.g. an OpenSSL without SM4
                raise KeyUnavailable(f"target {self.target.name}: {e}", retryable=False) from None
        try:
            return ciphers.reencrypt_to_current(stored)
        except VerificationFailed:
            raise KeyUnavailable(f"target {self.target.name}: a value re-encrypted under key "
                                 f"{self.keyring.current} did not verify", retryable=False) from None

    # -- SQL ---------------------------------------------------------------------------------

    def _candidates(self) -> tuple[sql.Composable, list[Any]]:
        """Rows that may hold a stale value: a plain column not starting with an active prefix,
        or any JSON column (its fields are only known once parsed)."""
        conds: list[sql.Composable] = []
        params: list[Any] = []
        for column in self.target.columns:
            ident = sql.Identifier(column.name)
            if self.target.settings.json_paths.get(column.name):
                conds.append(sql.SQL("{} IS NOT NULL").format(ident))
                continue
            not_active = [sql.SQL("NOT starts_with({}::text, %s)").format(ident) for _ in self._active_prefixes]
            conds.append(sql.SQL("({} IS NOT NULL AND {})").format(ident, sql.SQL(" AND ").join(not_active)))
            params += self._active_prefixes
        return sql.SQL("({})").format(sql.SQL(" OR ").join(conds)), params

    def _select(self, after: bool, limit: bool) -> tuple[sql.Composed, list[Any]]:
        t = self.target.settings
        scope, params = scope_condition(t, self.options.tenant)
        candidates, cand_params = self._candidates()
        tenant = sql.SQL("{}::text").format(sql.Identifier(t.tenant)) if t.tenant else sql.SQL("NULL::text")
        where: list[sql.Composable] = [scope, candidates]
        params = params + cand_params
        if after:
            where.append(sql.SQL("{} > %s").format(sql.Identifier(t.id)))
        query = sql.SQL("SELECT {id}, {tenant}, {cols} FROM {rel} WHERE {where} ORDER BY {id}").format(
            id=sql.Identifier(t.id), tenant=tenant, cols=sql.SQL(", ").join(column_as_text(c) for c in self.target.columns),
            rel=self.target.relation, where=sql.SQL(" AND ").join(where))
        if limit:
            query += sql.SQL(" LIMIT %s")
        return query, params

    def _update(self, column: Column) -> sql.Composed:
        """Compare-and-swap for one column: only rows still holding the value read (and still in scope)."""
        t = self.target.settings
        col = sql.Identifier("t", column.name)
        if column.type_name == "jsonb":
            new, same = sql.SQL("u.pinrotate_new::jsonb"), sql.SQL("{} = u.pinrotate_original::jsonb").format(col)
        elif column.type_name == "json":
            new, same = sql.SQL("u.pinrotate_new::json"), sql.SQL("{}::text = u.pinrotate_original").format(col)
        else:
            new, same = sql.SQL("u.pinrotate_new"), sql.SQL("{} = u.pinrotate_original").format(col)
        scope, _ = scope_condition(t, self.options.tenant, alias="t")
        return sql.SQL(
            "UPDATE {rel} AS t SET {c} = {new} "
            "FROM unnest(%s::{idtype}[], %s::text[], %s::text[]) AS u(pinrotate_id, pinrotate_original, pinrotate_new) "
            "WHERE t.{id} = u.pinrotate_id AND {same} AND {scope} RETURNING t.{id}"
        ).format(rel=self.target.relation, c=sql.Identifier(column.name), new=new,
                 idtype=sql.SQL(self.target.id_column.sql_type), id=sql.Identifier(t.id), same=same, scope=scope)

    def count_backlog(self, conn: psycopg.Connection[Any]) -> int:
        """In-scope values not on the active key: HISTORICAL, LEGACY and UNKNOWN_KEY."""
        query, params = self._select(after=False, limit=False)
        stale = 0
        with conn.transaction(), conn.cursor(name="pinrotate_fpc1_backlog") as cur:
            cur.itersize = SCAN_ROWS
            cur.execute(query, params)
            for row in cur:
                for (column, paths), text in zip(self._columns, row[2:]):
                    for _, stored in values_of_column(column, paths, text):
                        if stored is not None and classify_value(stored, self.keyring, self.legacy_format).category in STALE:
                            stale += 1
        return stale

    # -- the pass ----------------------------------------------------------------------------

    def _should_stop(self) -> str | None:
        return stop_reason(self.options)

    def _prepare_session(self, conn: psycopg.Connection[Any]) -> None:
        prepare_session(conn, self.options.dry_run, relaxed_commit=False)

    def _write(self, conn: psycopg.Connection[Any], plan: Fpc1BatchPlan, result: Fpc1DrainResult) -> _BatchOutcome:
        """One transaction: one CAS UPDATE per changed column; counts what matched and what did not."""
        outcome = _BatchOutcome()
        _, scope_params = scope_condition(self.target.settings, self.options.tenant)
        lost: list[tuple[Any, str, str, int]] = []
        with conn.transaction():
            begin_writing_batch(conn, self.target)  # issue 9: triggers = "disable" (port to the new drain)
            for column, write in plan.writes.items():
                cur = conn.execute(self._update_sql[column], [write.ids, write.originals, write.updated, *scope_params])
                matched = {r[0] for r in cur.fetchall()}
                for row_id, tenant, n in zip(write.ids, write.tenants, write.values):
                    if row_id in matched:
                        outcome.reencrypted += n
                    else:
                        lost.append((row_id, column, tenant, n))
        # Counted only once the COMMIT went through.
        for row_id, column, tenant, n in lost:
            outcome.conflicts += n
            result.conflicts_by_tenant[tenant] = result.conflicts_by_tenant.get(tenant, 0) + n
            log_event("value_conflict", level=30, run_id=self.options.run_id or None, target=self.target.name,
                      id=str(row_id), column=column, values=n)
        return outcome

    def _pass(self, result: Fpc1DrainResult) -> str | None:
        opts = self.options
        name = self.target.name
        with raw_connection(self.engine) as conn:
            self._prepare_session(conn)
            first, first_params = self._select(after=False, limit=True)
            more, more_params = self._select(after=True, limit=True)
            last: Any = None
            batch_no = 0
            while True:
                reason = self._should_stop()
                if reason:
                    return reason
                started = time.perf_counter()
                if last is None:
                    rows = conn.execute(first, [*first_params, opts.batch_size]).fetchall()
                else:
                    rows = conn.execute(more, [*more_params, last, opts.batch_size]).fetchall()
                if not rows:
                    return None
                batch_no += 1
                last = rows[-1][0]
                plan = plan_fpc1_batch(name, self._columns, rows, self.keyring, self.rewrite,
                                       legacy_format=self.legacy_format, legacy_read_enabled=self.legacy_read_enabled)
                if self.before_write is not None:
                    self.before_write(batch_no, [r[0] for r in rows])
                if opts.dry_run:
                    outcome = _BatchOutcome(reencrypted=plan.planned)
                else:
                    outcome = self._write(conn, plan, result)
                self._record(result, batch_no, len(rows), plan, outcome, started)
                if len(rows) < opts.batch_size:
                    return None
                if opts.inter_batch_delay and opts.stop.wait(opts.inter_batch_delay):
                    return STOP_CANCELLED

    def _record(self, result: Fpc1DrainResult, batch_no: int, rows: int, plan: Fpc1BatchPlan,
                outcome: _BatchOutcome, started: float) -> None:
        opts = self.options
        name = self.target.name
        result.batches += 1
        result.reencrypted += outcome.reencrypted
        result.conflicts += outcome.conflicts
        result.active += plan.active
        result.unknown += plan.unknown
        result.unknown_key += plan.unknown_key
        result.legacy_left += plan.legacy_left
        result.failed.extend(plan.failed)
        event = Fpc1BatchEvent(name, 0, batch_no, rows, outcome.reencrypted, len(plan.failed),
                               (time.perf_counter() - started) * 1000, opts.dry_run, conflicts=outcome.conflicts)
        log_event("batch_processed", run_id=opts.run_id or None, target=name, worker=0, batch=batch_no, rows=rows,
                  reencrypted=event.reencrypted, failed=event.failed, conflicts=event.conflicts or None,
                  unknown=plan.unknown or None, legacy_left=plan.legacy_left or None,
                  duration_ms=round(event.duration_ms, 1), dry_run=opts.dry_run or None)
        for f in plan.failed:
            log_event("row_failed", level=30, run_id=opts.run_id or None, target=name, id=f.id,
                      columns=list(f.columns), reason=f.reason)
        if opts.on_batch is not None:
            opts.on_batch(event)

    def _guarded_pass(self, result: Fpc1DrainResult) -> str | None:
        try:
            return self._pass(result)
        except KeyUnavailable as e:
            return self._fail(result, e, STOP_KEY_UNAVAILABLE, retryable=e.retryable)
        except DatabaseError as e:
            return self._fail(result, e, STOP_DB_ERROR, retryable=True)
        except psycopg.Error as e:
            err = DatabaseError(f"target {self.target.name}: batch rolled back ({describe_db_error(e)})")
            return self._fail(result, err, STOP_DB_ERROR, retryable=True)

    def _fail(self, result: Fpc1DrainResult, exc: BaseException, reason: str, *, retryable: bool) -> str:
        result.error = str(exc)
        result.retryable = retryable
        log_event("batch_failed", level=40, run_id=self.options.run_id or None, target=self.target.name,
                  worker=0, reason=reason, error=str(exc))
        return reason

    def run(self) -> Fpc1DrainResult:
        opts = self.options
        name = self.target.name
        started = time.perf_counter()
        result = Fpc1DrainResult(name, self.keyring.current, dry_run=opts.dry_run)
        try:
            with raw_connection(self.engine) as conn:
                if opts.dry_run:
                    conn.execute("SET default_transaction_read_only = on")
                result.backlog_before = self.count_backlog(conn)
        except (psycopg.Error, DatabaseError) as e:
            result.stopped, result.retryable = STOP_DB_ERROR, True
            result.error = str(e) if isinstance(e, DatabaseError) else f"target {name}: {describe_db_error(e)}"
            return result
        log_event("target_started", run_id=opts.run_id or None, target=name, current_key=self.keyring.current,
                  backlog=result.backlog_before, workers=1, dry_run=opts.dry_run or None)
        result.stopped = self._guarded_pass(result) if result.backlog_before else None
        result.failed.sort(key=lambda f: (f.id, f.reason))
        if opts.dry_run:
            result.backlog_remaining = result.backlog_before - result.reencrypted
        else:
            self._finish_real_run(result)
        result.duration_ms = (time.perf_counter() - started) * 1000
        log_event("target_completed", run_id=opts.run_id or None, target=name, reencrypted=result.reencrypted,
                  failed=len(result.failed), conflicts=result.conflicts, unknown=result.unknown or None,
                  unknown_key=result.unknown_key or None, legacy_left=result.legacy_left or None,
                  batches=result.batches, backlog_remaining=result.backlog_remaining, stopped=result.stopped,
                  duration_ms=round(result.duration_ms, 1), dry_run=opts.dry_run or None)
        return result

    def _finish_real_run(self, result: Fpc1DrainResult) -> None:
        """Recount the backlog and save this run's CONFLICT counts for the gate."""
        try:
            with raw_connection(self.engine) as conn:
                result.backlog_remaining = self.count_backlog(conn)
                identity = database_identity(conn)
        except (psycopg.Error, DatabaseError):
            result.backlog_remaining = result.backlog_before - result.reencrypted
            identity = None
        if identity is None:
            result.state_error = "the CONFLICT counts could not be saved: the database was unreachable"
        else:
            try:
                record_conflicts(identity, self.target.name, result.conflicts_by_tenant,
                                 tenant_scope=self.options.tenant, complete=result.stopped is None,
                                 run_id=self.options.run_id)
            except StateError as e:
                result.state_error = str(e)
        if result.state_error is not None:
            # Fail closed: a gate that cannot see this run's conflicts must not open on its word.
            log_event("state_not_saved", level=40, run_id=self.options.run_id or None, target=self.target.name,
                      error=result.state_error)


def run_fpc1_drain(engine: sa.Engine, target: ResolvedTarget, keyring: Keyring, options: DrainOptions,
                   keys: KeysSettings | None = None) -> Fpc1DrainResult:
    return Fpc1Drain(engine, target, keyring, options, keys=keys).run()


__all__ = ["Fpc1BatchEvent", "Fpc1BatchPlan", "Fpc1Drain", "Fpc1DrainResult", "plan_fpc1_batch", "run_fpc1_drain"]
