"""One rotation run, step by step: read the current key, drain each target, verify, report.

The steps are separate functions so that the Prefect flow can make each one a task; ``run_rotation``
composes them for a plain Python caller (no orchestrator needed). Nothing here prints or exits.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa

from .commands import EngineCommands, commands_for
from .config import Settings, TargetSettings
from .conflicts import StateError
from .db import database_url, make_engine
from .drain import BatchEvent, DrainOptions, DrainResult, Shard
from .drain.results import CONFLICTS_UNRECORDED
from .errors import DatabaseError, RefusedToStart
from .forge_discovery import with_forge_targets
from .gate.verdict import GateReport
from .inventory import Inventory
from .keyring import Keyring
from .log import log_event
from .providers import KeyProvider, build_provider

# The report and exit codes live in run_report; callers name them rotation.* (explicit re-exports, as mypy
# --strict wants them).
# ruff: noqa: PLC0414
from .run_report import (
    EXIT_CONFIG as EXIT_CONFIG,
)
from .run_report import (
    EXIT_FAIL_CLOSED as EXIT_FAIL_CLOSED,
)
from .run_report import (
    EXIT_GATE_CLOSED as EXIT_GATE_CLOSED,
)
from .run_report import (
    EXIT_INTERRUPTED as EXIT_INTERRUPTED,
)
from .run_report import (
    EXIT_OK as EXIT_OK,
)
from .run_report import (
    EXIT_TERMINATED as EXIT_TERMINATED,
)
from .run_report import (
    EXIT_UNEXPECTED as EXIT_UNEXPECTED,
)
from .run_report import (
    RunReport as RunReport,
)
from .run_report import (
    record_metrics as record_metrics,
)
from .run_report import (
    target_report as target_report,
)
from .schemes.base import DECRYPT_FAILED, NOT_STORED, LegacyMigration, Scheme
from .schemes.registry import check_keyring, scheme_class, write_guard
from .scope import check_tenant_scope
from .throttle import Throttle, ThrottleControlSource

LOCK_NAME = "Pin:lock:job:scheduled:profile-reencrypt"
VERIFY_SAMPLE = 64


@dataclass
class RunContext:
    """Everything one run needs, built once at its start. In-memory only: never a task parameter."""

    settings: Settings
    engine: sa.Engine
    provider: KeyProvider
    targets: list[TargetSettings]
    run_id: str
    dry_run: bool = False
    expected_key: str | None = None
    tenant: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    keyring: Keyring | None = None
    schemes: dict[str, Scheme] = field(default_factory=dict)
    # Sharing the database (issue 12): an orchestrator's pause / tune switch, and the run's one
    # throttle (every target and worker of the run shares it, and with it the waits it counts).
    throttle_control: ThrottleControlSource | None = None
    throttle: Throttle | None = None

    @property
    def deadline(self) -> float:
        return self.started + self.settings.job.max_run_duration

    @property
    def throttled(self) -> bool:
        """Does anything pace this run's batches (adaptive size, health limits, an operator's switch)?"""
        job = self.settings.job
        return (self.throttle_control is not None or job.adaptive_batch_target is not None
                or any(v is not None for v in (job.max_replica_lag, job.critical_replica_lag,
                                               job.max_active_sessions, job.critical_active_sessions)))

    @functools.cached_property
    def commands(self) -> EngineCommands:
        """The database engine's path through each step that differs by engine, chosen once from the
        URL (``commands/``: PostgreSQL, or MySQL / MariaDB through ``commands/mysql/``)."""
        return commands_for(self.settings)

    def run_throttle(self) -> Throttle:
        if self.throttle is None:
            self.throttle = self.commands.make_throttle(self.engine, self.settings, control=self.throttle_control,
                                                        run_id=self.run_id, writes=not self.dry_run)
        return self.throttle

    def close(self) -> None:
        if self.throttle is not None:
            self.throttle.close()
        self.engine.dispose()


def open_run(settings: Settings, *, target_names: Sequence[str] = (), dry_run: bool = False,
             expected_key: str | None = None, tenant: str | None = None, run_id: str | None = None,
             engine: sa.Engine | None = None, create_keyring: bool = False) -> RunContext:
    """Validate everything that can be validated before touching the database. ``create_keyring``:
    only for a run's first start (contract §3, "created on first use"): a ``file`` keyring absent
    there is created; every other step (a shard, a worker, verify) refuses a missing one."""
    if engine is None:
        workers = settings.job.max_degree_of_parallelism
        engine = make_engine(database_url(settings), pool_size=3 * workers + 2)
    try:
        settings = with_forge_targets(settings, engine)  # Forge's own tables, read at every start
        targets = [settings.target(n) for n in target_names] if target_names else list(settings.targets)
        check_tenant_scope(targets, tenant)
        provider = build_provider(settings, create_keyring=create_keyring)
    except BaseException:
        engine.dispose()
        raise
    return RunContext(settings=settings, engine=engine, provider=provider, targets=targets,
                      run_id=run_id or str(uuid.uuid4()), dry_run=dry_run, expected_key=expected_key, tenant=tenant)


def read_current_key(ctx: RunContext, *, announce: bool = True, record: bool | None = None) -> Keyring:
    """Read the keyring once for the run and check the start conditions (§4 refusals).

    ``record=False``: the check before a run exists (the CLI's, before the flow run has an id) only
    compares, under no run id: the run itself records its keys under its own (the flow run's) id."""
    keyring = ctx.provider.load_keyring()
    apply_key_policy(ctx, keyring)
    check_start(ctx, keyring)
    # Before anything is written: each key id is the key recorded for it (a dry run only compares).
    recording = not ctx.dry_run if record is None else record
    run_id = None if record is False else ctx.run_id
    quiet = record is False  # the check before the run: the run itself says what it found
    ctx.commands.confirm_key_identity(ctx.engine, ctx.settings, keyring, ctx.provider, record=recording, run_id=run_id,
                                      quiet=quiet)
    ctx.keyring = keyring
    if announce:
        log_event("job_started", run_id=ctx.run_id, current_key=keyring.current, provider=ctx.provider.description,
            targets=[t.name for t in ctx.targets], dry_run=ctx.dry_run or None)
    return keyring


def apply_key_policy(ctx: RunContext, keyring: Keyring) -> None:
    """A key source that carries the legacy-migration switches itself (Forge's settings) decides them:
    pinrotate refuses and reads legacy values exactly when Forge's own migration endpoint would."""
    if keyring.policy is None:
        return
    keys = ctx.settings.keys.model_copy(update={"write_versioned": keyring.policy.write_versioned,
                                                "legacy_read_enabled": keyring.policy.legacy_read_enabled})
    ctx.settings = ctx.settings.model_copy(update={"keys": keys})


def check_start(ctx: RunContext, keyring: Keyring) -> None:
    formats = {t.format for t in ctx.targets}
    if ctx.expected_key is not None and ctx.expected_key != keyring.current:
        raise RefusedToStart(
            f"--expected-key-version {ctx.expected_key} is not the current key ({keyring.current}); nothing was touched")
    check_keyring(formats, keyring, ctx.settings.keys)
    if not ctx.dry_run:  # what a scheme asks of a run that writes (fpc1: Forge's migration preconditions)
        for scheme in map(scheme_class, sorted(formats)):
            if isinstance(scheme, LegacyMigration):
                scheme.check_start(ctx.settings.keys, keyring, ctx.expected_key)


def resolve_all(ctx: RunContext) -> dict[str, Scheme]:
    """Resolve every target and bind its scheme before anything is written: one blocked target
    stops the start (exit 2)."""
    assert ctx.keyring is not None, "read_current_key first"
    ctx.commands.resolve_targets(ctx.engine, ctx.settings, ctx.targets, ctx.keyring, ctx.provider, tenant=ctx.tenant,
                                 dry_run=ctx.dry_run, into=ctx.schemes)
    return ctx.schemes


def drain(ctx: RunContext, name: str, *, workers: int | None = None,
          on_batch: Callable[[BatchEvent], None] | None = None,
          id_range: tuple[Any, Any] = (None, None), planned_backlog: int | None = None,
          shard: str = "") -> DrainResult:
    """Drain one target, or one shard of it (``id_range``: ids in ``(lo, hi]``, None an open end;
    ``planned_backlog``: its backlog as ``plan_shards`` counted it, so the drain need not count again)."""
    options = replace(_drain_options(ctx, workers, on_batch, id_range), planned_backlog=planned_backlog, shard=shard)
    return ctx.commands.drain(ctx.engine, ctx.schemes[name], options)


def _drain_options(ctx: RunContext, workers: int | None = None, on_batch: Callable[[BatchEvent], None] | None = None,
                   id_range: tuple[Any, Any] = (None, None)) -> DrainOptions:
    assert ctx.keyring is not None, "read_current_key first"
    job = ctx.settings.job
    return DrainOptions(batch_size=job.batch_size, workers=workers or job.max_degree_of_parallelism,
                        inter_batch_delay=job.inter_batch_delay, deadline=ctx.deadline, dry_run=ctx.dry_run,
                        stop=ctx.stop, on_batch=on_batch, run_id=ctx.run_id, tenant=ctx.tenant,
                        lock_timeout=job.lock_timeout, statement_timeout=job.statement_timeout,
                        idle_timeout=job.batch_idle_timeout,
                        throttle=ctx.run_throttle() if ctx.throttled else None, id_range=id_range)


def plan_shards(ctx: RunContext, name: str, shards: int) -> list[Shard]:
    """A target's backlog as at most ``shards`` id ranges of similar row counts, each with its backlog
    (one range for a target with nothing to do): the shards a distributed run drains side by side.
    A big table's backlogs are estimates (``Shard.exact`` false); a drain started from one counts
    what it leaves when it ends, as every drain does."""
    return ctx.commands.plan_shards(ctx.engine, ctx.schemes[name], _drain_options(ctx), shards)


def record_run_conflicts(ctx: RunContext, results: dict[str, DrainResult], sharded: Sequence[str]) -> None:
    """Once every shard of a ``sharded`` target has ended: record the run's CONFLICT counts for it,
    as an unsharded run does (each shard only added its own, clearing nothing). Replaces what
    earlier runs left when every shard completed, else keeps the larger count. A failure to record
    leaves the target fail-closed (``state_error``)."""
    names = [t.name for t in ctx.targets if t.name in sharded and t.name in results and write_guard(t.format) == "cas"]
    if ctx.dry_run or not names:
        return
    try:
        # On MySQL in the server's pinrotate database (commands/mysql/bookkeeping.py); the same rules either way.
        with ctx.commands.conflicts_recorder(ctx.engine) as record:
            for name in names:
                r = results[name]
                try:
                    record(name, r.conflicts_by_tenant, tenant_scope=ctx.tenant, complete=r.stopped is None,
                           run_id=ctx.run_id)
                except StateError as e:
                    r.state_error = str(e)
    except DatabaseError:
        for name in names:
            results[name].state_error = CONFLICTS_UNRECORDED
    for name in names:
        r = results[name]
        if r.state_error is not None:
            r.error = r.error or f"target {name}: {r.state_error}"
            log_event("state_not_saved", level=40, run_id=ctx.run_id, target=name, error=r.state_error)


def verify(ctx: RunContext, results: dict[str, DrainResult]) -> dict[str, Any]:
    """After the drains: what is left on older keys, and do re-encrypted rows read back?"""
    out: dict[str, Any] = {}
    with ctx.commands.verifier(ctx.engine) as verify_sample:
        for name, result in results.items():
            entry: dict[str, Any] = {"backlog": result.backlog_remaining}
            if not ctx.dry_run and result.sample_ids:
                sampled, ok = verify_sample(ctx.schemes[name], result.sample_ids)
                entry.update(sampled=sampled, decrypted=ok, ok=(ok == sampled))
            else:
                entry.update(sampled=0, decrypted=0, ok=True)
            out[name] = entry
    return out


def gate_report(ctx: RunContext, results: dict[str, DrainResult]) -> dict[str, Any]:
    """The run asks the gate (it computes no verdict of its own): one entry per older key."""
    assert ctx.keyring is not None
    # A row that does not decrypt, or that did not store the value written (left on its old key).
    failed = {name: sum(1 for f in r.failed if f.reason in (DECRYPT_FAILED, NOT_STORED)) for name, r in results.items()}
    conflicts = {name: r.conflicts for name, r in results.items()}
    return ctx.commands.run_gate(ctx.engine, ctx.settings, ctx.keyring, ctx.provider, targets=ctx.targets,
                                 tenant=ctx.tenant, failed=failed, conflicts=conflicts, run_id=ctx.run_id)


@contextlib.contextmanager
def single_instance(ctx: RunContext) -> Iterator[bool]:
    """Hold the advisory lock of contract §7 for the run when configured; yields False if it is held."""
    if not ctx.settings.job.single_instance:
        yield True
        return
    # The room's advisory lock, held by this connection's session: GET_LOCK (server-wide) on MySQL,
    # pg_try_advisory_lock (per database) on PostgreSQL.
    with ctx.commands.advisory_lock(ctx.engine, LOCK_NAME) as held:
        yield held


def run_rotation(settings: Settings, *, target_names: Sequence[str] = (), dry_run: bool = False,
                 expected_key: str | None = None, tenant: str | None = None,
                 stop: threading.Event | None = None,
                 throttle_control: ThrottleControlSource | None = None) -> RunReport:
    """The whole run without an orchestrator: targets drained one after another, in order.

    ``throttle_control``: an operator's pause / tune switch read between batches (see throttle/)."""
    ctx = open_run(settings, target_names=target_names, dry_run=dry_run, expected_key=expected_key, tenant=tenant,
                   create_keyring=True)
    if stop is not None:
        ctx.stop = stop
    ctx.throttle_control = throttle_control
    try:
        keyring = read_current_key(ctx)
        resolve_all(ctx)
        report = RunReport(ctx.run_id, keyring.current, dry_run)
        with single_instance(ctx) as got:
            if not got:
                report.skipped = f"another run holds the lock {LOCK_NAME}"
                return report
            for t in ctx.targets:
                report.targets[t.name] = drain(ctx, t.name)
            report.verified = verify(ctx, report.targets)
            report.gate = gate_report(ctx, report.targets)
        report.cancelled = ctx.stop.is_set()
        report.duration_ms = (time.monotonic() - ctx.started) * 1000
        conclude(ctx, report)
        return report
    finally:
        ctx.close()


def inventory(settings: Settings, *, deep: bool = False, tenant: str | None = None) -> Inventory:
    """``inventory``: read-only counts per target and key, by the database engine's path."""
    return commands_for(settings).inventory(settings, deep=deep, tenant=tenant)


def retire_gate(settings: Settings, key: str, *, tenant: str | None = None, deep: bool = True,
                erase_excluded: bool = False) -> GateReport:
    """``gate --retire KEY``: may the key be destroyed now? By the database engine's path, as the
    command line asks it (``gate.retire_gate`` is PostgreSQL's)."""
    return commands_for(settings).retire_gate(settings, key, tenant=tenant, deep=deep, erase_excluded=erase_excluded)


def conclude(ctx: RunContext, report: RunReport) -> None:
    """The end of every run, however it was driven: deliver its metrics, log job_completed."""
    for line in deliver_metrics(ctx, report):
        log_event("metrics_delivered", run_id=ctx.run_id, result=line)
    log_event("job_completed", run_id=ctx.run_id, exit_code=report.exit_code,
              reencrypted=sum(r.reencrypted for r in report.targets.values()),
              backlog_remaining=sum(r.backlog_remaining for r in report.targets.values()),
              duration_ms=round(report.duration_ms), cancelled=report.cancelled or None)


def deliver_metrics(ctx: RunContext, report: RunReport) -> list[str]:
    from .metrics import RotationMetrics

    metrics = RotationMetrics.from_settings(ctx.settings.metrics)
    record_metrics(report, metrics)
    if ctx.throttle is not None:
        ctx.throttle.record(metrics)
    return metrics.deliver(ctx.settings.metrics)
