"""fpc1 CONFLICTs on real PostgreSQL: runs side by side, and the record the gate reads on any host.
(tests/test_conflicts_mysql.py runs the bodies of the first three on MariaDB.)

Two runs at once are two processes: the first run's ``before_write`` hook (between a batch's read
and its write) starts a second, complete run in a child process (its own interpreter, its own
``PINROTATE_HOME``, as on another host) and waits for it to end; then the first run writes. The
CONFLICT records live in the database (``pinrotate.conflicts``), never in a file of one host.
Roles are real LOGIN roles without superuser rights. All keys are random TEST keys.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import rotation
from pinrotate_core.config import GateSettings
from pinrotate_core.conflicts import CREATE_SQL, conflicts_table_exists
from pinrotate_core.drain import DrainOptions, DrainResult
from pinrotate_core.errors import RefusedToStart
from pinrotate_core.key_checks import CREATE_SQL as KEY_CHECKS_SQL
from pinrotate_core.rotation import retire_gate
from pinrotate_core.schemes.fpc1_values import parse_fpc1
from tests.helpers import url_as

from .fpc1_db import Fpc1Db
from .test_fpc1_migration import (
    DC,
    K1,
    K2,
    LC,
    Forge,
    custom_settings,
    decrypt,
    forge_settings,
    fpc1,
    pg_fpc1_db,  # noqa: F401 (the fixture db)
    write_keys,
)

# --- a second run in another process ----------------------------------------------------------------


def _second_run(database_url: str, keys_file: str, target: str, home: str) -> None:
    """Child process: a complete, ordinary run of ``target`` as another host would start it."""
    os.environ["PINROTATE_HOME"] = home
    # Its gate waits for transactions in flight, and the first run's batch stays open until this
    # run ends: a short wait (the gate closes, IN_FLIGHT) keeps that batch within its idle timeout.
    settings = forge_settings(database_url, Path(keys_file)).model_copy(update={"gate": GateSettings(wait=1)})
    report = rotation.run_rotation(settings, target_names=[target], expected_key="k2")
    raise SystemExit(report.exit_code)


def run_beside(database_url: str, keys_file: Path, target: str, home: Path) -> int:
    """Start the second run in a fresh interpreter and wait for it; its exit code."""
    child = multiprocessing.get_context("spawn").Process(
        target=_second_run, args=(database_url, str(keys_file), target, str(home)))
    child.start()
    child.join(timeout=300)
    assert child.exitcode is not None, "the second run did not end"
    return child.exitcode


def run_with_hook(settings: Any, target: str, hook: Any) -> rotation.RunReport:
    """The run's own steps (as run_rotation composes them), the drain with ``hook`` before each write."""
    ctx = rotation.open_run(settings, target_names=[target], expected_key="k2")
    try:
        keyring = rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        report = rotation.RunReport(ctx.run_id, keyring.current, False)
        options = DrainOptions(batch_size=settings.job.batch_size, run_id=ctx.run_id, before_write=hook)
        report.targets[target] = ctx.commands.drain(ctx.engine, ctx.schemes[target], options)
        report.verified = rotation.verify(ctx, report.targets)
        report.gate = rotation.gate_report(ctx, report.targets)
        return report
    finally:
        ctx.close()


@pytest.mark.parametrize("target", [DC, LC])
def test_a_value_another_run_moved_meanwhile_is_done_not_a_conflict(
        db: Fpc1Db, keys_file: Path, tmp_path: Path, target: str) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    seen: dict[str, Any] = {}

    def second_run_completes_first(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            seen["ids"] = list(ids)
            seen["exit"] = run_beside(db.url, keys_file, target, tmp_path / "other-host")

    report = run_with_hook(settings, target, second_run_completes_first)

    assert seen["exit"] == rotation.EXIT_OK
    result = report.targets[target]
    # Batch 1's values were moved by the other run between this run's read and write: each one a
    # compare-and-swap miss whose value is now on k2 with the same plaintext, so done, not CONFLICT.
    assert result.conflicts == 0 and result.counts.get("settled_elsewhere", 0) >= 1
    assert result.reencrypted == 0 and result.backlog_remaining == 0 and not result.failed
    assert report.exit_code == rotation.EXIT_OK
    # Only this target was run: the gate (over every configured target) stays closed by the other
    # one; this target's slice has nothing left on either key.
    assert not report.gate["k1"]["open"] and not report.gate["legacy"]["open"]
    for key in ("k1", "legacy"):
        assert report.gate[key]["slice"]["targets"] == {target: {"on_key": 0, "excluded_on_key": int(key == "k1"),
                                                                 "blocking": {"EXCLUDED": 1} if key == "k1" else {}}}
    assert rotation.inventory(settings).targets[target].counts["CONFLICT"] == 0
    # Every value once, on k2, with its plaintext.
    if target == DC:
        for row_id in (1, 2, 3, 4, 7):
            value = forge.password(row_id)
            assert value is not None and parse_fpc1(value).key_id == "k2"
            assert decrypt(value) == forge.plain[("dc", row_id, "password")]
    else:
        for row_id in (1, 2):
            doc = json.loads(forge.config(row_id))
            for name in ("password", "token"):
                assert parse_fpc1(doc[name]).key_id == "k2"
                assert decrypt(doc[name]) == forge.plain[("lc", row_id, f"$.{name}")]


def test_an_application_edit_during_two_runs_is_still_a_conflict(
        db: Fpc1Db, keys_file: Path, tmp_path: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    app_value = fpc1("k2", K2, b"a new password typed by the user")

    def other_run_then_application(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            assert run_beside(db.url, keys_file, DC, tmp_path / "other-host") == rotation.EXIT_OK
            # Same key as the other run's value, another plaintext: the application's, never ours to replace.
            db.execute("UPDATE data_connections SET password = %s WHERE id = 2", (app_value,))

    report = run_with_hook(settings, DC, other_run_then_application)

    result = report.targets[DC]
    assert result.conflicts == 1 and result.counts.get("settled_elsewhere", 0) >= 1
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED and not report.gate["k1"]["open"]
    assert forge.password(2) == app_value


# --- the record is in the database ------------------------------------------------------------------


def edit_row_2_between_read_and_write(db: Fpc1Db, value: str) -> Any:
    def hook(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            db.execute("UPDATE data_connections SET password = %s WHERE id = 2", (value,))
    return hook


def test_a_conflict_recorded_on_one_host_closes_the_gate_on_another(
        db: Fpc1Db, keys_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    host_a.mkdir()
    host_b.mkdir()
    assert db.no_conflict_records()

    monkeypatch.setenv("PINROTATE_HOME", str(host_a))
    app_value = fpc1("k2", K2, b"edited while the run ran")
    report = run_with_hook(settings, DC, edit_row_2_between_read_and_write(db, app_value))
    assert report.targets[DC].conflicts == 1 and report.exit_code == rotation.EXIT_FAIL_CLOSED
    assert forge.password(2) == app_value
    assert not any(host_a.iterdir())  # nothing of it in host A's folder

    monkeypatch.setenv("PINROTATE_HOME", str(host_b))
    gate = retire_gate(settings, "k1")
    assert not gate.open and gate.blocking["CONFLICT"] == 1
    assert rotation.inventory(settings).targets[DC].counts["CONFLICT"] == 1
    assert rotation.inventory(settings, tenant="1").targets[DC].counts["CONFLICT"] == 1
    assert rotation.inventory(settings, tenant="2").targets[DC].counts["CONFLICT"] == 0

    # Host B's clean run clears it for everyone.
    clean = rotation.run_rotation(settings, expected_key="k2")
    assert clean.exit_code == rotation.EXIT_OK
    monkeypatch.setenv("PINROTATE_HOME", str(host_a))
    assert retire_gate(settings, "k1", erase_excluded=True).open  # only the soft-deleted rows are left
    assert db.conflict_rows() == []


def test_a_run_that_stopped_early_keeps_the_larger_count_and_clears_nothing(
        database_url: str, pg_conn: psycopg.Connection[Any]) -> None:
    from pinrotate_core.conflicts import last_conflicts, record_conflicts

    record_conflicts(pg_conn, "T", {"a": 3, "b": 1}, tenant_scope=None, complete=True, run_id="r1")
    record_conflicts(pg_conn, "T", {"a": 1, "c": 2}, tenant_scope=None, complete=False, run_id="r2")
    assert {t: last_conflicts(pg_conn, "T", tenant=t) for t in "abc"} == {"a": 3, "b": 1, "c": 2}
    record_conflicts(pg_conn, "T", {}, tenant_scope="a", complete=True, run_id="r3")  # a clean run of tenant a
    assert last_conflicts(pg_conn, "T") == 3 and last_conflicts(pg_conn, "T", tenant="a") == 0
    record_conflicts(pg_conn, "T", {"b": 4}, tenant_scope=None, complete=True, run_id="r4")
    assert last_conflicts(pg_conn, "T") == 4
    assert last_conflicts(pg_conn, "other") == 0


# --- privileges ---------------------------------------------------------------------------------------


@pytest.fixture
def app_role(make_role: Callable[[str], str]) -> str:
    return make_role("app")


def creds_table(pg_conn: psycopg.Connection[Any], role: str) -> list[str]:
    values = [fpc1("k1", K1, f"password {i}".encode()) for i in range(3)]
    pg_conn.execute("CREATE TABLE creds (id bigint PRIMARY KEY, pw text)")
    pg_conn.cursor().executemany("INSERT INTO creds VALUES (%s, %s)", list(enumerate(values, 1)))
    pg_conn.execute(sql.SQL("GRANT SELECT, UPDATE ON creds TO {}").format(sql.Identifier(role)))
    return values


def grant_key_checks(pg_conn: psycopg.Connection[Any], role: str, privileges: str = "SELECT, INSERT") -> None:
    """pinrotate.key_checks created ahead and granted (the role may not create it), so that a test of
    pinrotate.conflicts gets past the key identity check of the start."""
    pg_conn.execute(KEY_CHECKS_SQL)
    pg_conn.execute(sql.SQL("GRANT USAGE ON SCHEMA pinrotate TO {r}; GRANT {p} ON pinrotate.key_checks TO {r}").format(
        r=sql.Identifier(role), p=sql.SQL(privileges)))


def test_a_role_that_may_not_create_the_conflicts_table_is_refused_before_anything_is_written(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, app_role: str) -> None:
    values = creds_table(pg_conn, app_role)
    write_keys(keys_file)
    grant_key_checks(pg_conn, app_role)
    settings = custom_settings(url_as(database_url, app_role), keys_file, {"table": "creds", "columns": ["pw"]})

    with pytest.raises(RefusedToStart) as refused:
        rotation.run_rotation(settings, expected_key="k2")
    message = str(refused.value)
    assert "\n" not in message
    assert re.search(rf"role {app_role} may not create pinrotate\.conflicts.*GRANT CREATE ON DATABASE", message)
    assert message.endswith("nothing was touched")
    assert [r[0] for r in pg_conn.execute("SELECT pw FROM creds ORDER BY id")] == values
    # A dry run records nothing, so it needs no table.
    assert rotation.run_rotation(settings, dry_run=True).exit_code == rotation.EXIT_OK

    # The administrator creates it ahead (the documented DDL) and grants it: the run goes through,
    # without asking for CREATE again.
    pg_conn.execute(CREATE_SQL)
    pg_conn.execute(sql.SQL("GRANT USAGE ON SCHEMA pinrotate TO {r}; "
                            "GRANT SELECT, INSERT, UPDATE, DELETE ON pinrotate.conflicts TO {r}").format(
        r=sql.Identifier(app_role)))
    report = rotation.run_rotation(settings, expected_key="k2")
    assert report.exit_code == rotation.EXIT_OK and report.targets["T"].reencrypted == 3
    # A gate must see every session of the database (other roles' too) to know none is in flight.
    pg_conn.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(sql.Identifier(app_role)))
    assert retire_gate(settings, "k1").open


def test_a_gate_role_that_may_not_read_the_conflicts_table_is_blocked_and_an_absent_table_is_no_conflict(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, app_role: str) -> None:
    creds_table(pg_conn, app_role)
    write_keys(keys_file)
    target = {"table": "creds", "columns": ["pw"]}
    reader = custom_settings(url_as(database_url, app_role), keys_file, target)
    owner = custom_settings(database_url, keys_file, target)

    # No run has recorded anything: no table, no conflict; the read-only gate creates nothing.
    inv = rotation.inventory(reader).targets["T"]
    assert inv.counts["CONFLICT"] == 0 and inv.counts["BLOCKED"] == 0 and inv.counts["HISTORICAL"] == 3
    assert not conflicts_table_exists(pg_conn)

    assert rotation.run_rotation(owner, expected_key="k2").exit_code == rotation.EXIT_OK
    assert conflicts_table_exists(pg_conn)
    grant_key_checks(pg_conn, app_role, "SELECT")  # the gate compares its keys with the recorded ones
    assert retire_gate(owner, "k1").open

    # The table exists and this role may not read it: conflicts it cannot see might exist.
    inv = rotation.inventory(reader).targets["T"]
    assert inv.counts["BLOCKED"] == 1
    assert f"role {app_role} may not read pinrotate.conflicts" in (inv.blocked_reason or "")
    gate = retire_gate(reader, "k1")
    assert not gate.open and gate.blocking["BLOCKED"] == 1


# --- sharded runs ---------------------------------------------------------------------------------------


SHARDED_ROWS = 120  # two shards of at least MIN_BATCHES_PER_SHARD batches of 2


def sharded_creds(pg_conn: psycopg.Connection[Any]) -> None:
    pg_conn.execute("CREATE TABLE creds (id bigint PRIMARY KEY, tenant text NOT NULL, pw text)")
    pg_conn.cursor().executemany("INSERT INTO creds VALUES (%s, %s, %s)",
                                 [(i, "a", fpc1("k1", K1, f"password {i}".encode())) for i in range(1, SHARDED_ROWS + 1)])


def drain_shards(settings: Any, pg_conn: psycopg.Connection[Any], stop_shard: int | None = None) -> tuple[
        rotation.RunContext, list[Any], list[int]]:
    """The flow's steps in one process: plan two shards, drain them one after the other (an
    application edit in each shard's first batch: one CONFLICT each), and leave the run open."""
    from pinrotate_core.conflicts import last_conflicts

    ctx = rotation.open_run(settings, target_names=["T"], expected_key="k2")
    rotation.read_current_key(ctx)
    rotation.resolve_all(ctx)
    shards = rotation.plan_shards(ctx, "T", 2)
    assert len(shards) == 2 and all(s.id_range != (None, None) for s in shards)
    results = []
    recorded = []
    for n, shard in enumerate(shards):
        stop = threading.Event()

        def edit_first_row(batch: int, ids: Sequence[Any], n: int = n, stop: threading.Event = stop) -> None:
            if batch == 1:
                pg_conn.execute("UPDATE creds SET pw = %s WHERE id = %s",
                                (fpc1("k2", K2, b"typed by the user"), ids[0]))
            if n == stop_shard and batch == 3:
                stop.set()

        options = DrainOptions(batch_size=2, run_id=ctx.run_id, before_write=edit_first_row, stop=stop,
                               id_range=shard.id_range, planned_backlog=shard.rows)
        results.append(ctx.commands.drain(ctx.engine, ctx.schemes["T"], options))
        recorded.append(last_conflicts(pg_conn, "T"))
    return ctx, results, recorded


def merge_results(parts: Sequence[DrainResult]) -> DrainResult:
    """As the flow folds a target's shards: conflicts add up, the first stop stands."""
    merged = DrainResult(parts[0].target, parts[0].current_key)
    for p in parts:
        merged.conflicts += p.conflicts
        for tenant, n in p.conflicts_by_tenant.items():
            merged.conflicts_by_tenant[tenant] = merged.conflicts_by_tenant.get(tenant, 0) + n
        merged.stopped = merged.stopped or p.stopped
    return merged


def test_sibling_shards_keep_each_others_conflicts_and_the_run_records_what_is_left(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    from pinrotate_core.conflicts import last_conflicts, record_conflicts

    sharded_creds(pg_conn)
    write_keys(keys_file)
    settings = custom_settings(database_url, keys_file, {"table": "creds", "columns": ["pw"], "tenant": "tenant"})
    # An earlier run left 5 conflicts; none of them stands any more (this run re-reads every row).
    record_conflicts(pg_conn, "T", {"a": 5}, tenant_scope=None, complete=True, run_id="earlier")

    ctx, results, recorded = drain_shards(settings, pg_conn)
    try:
        assert [r.conflicts for r in results] == [1, 1] and all(r.stopped is None for r in results)
        # The second shard to end erased nothing of the first one's.
        assert recorded[1] >= recorded[0] >= 5 and recorded[1] >= 6
        merged = {"T": merge_results(results)}
        rotation.record_run_conflicts(ctx, merged, ["T"])
    finally:
        ctx.close()
    assert merged["T"].state_error is None
    # Every shard completed: the run's count replaces the earlier one, and equals what is left.
    assert last_conflicts(pg_conn, "T") == 2
    gate = retire_gate(settings, "k1")
    assert not gate.open and gate.blocking["CONFLICT"] == 2


def test_a_sharded_run_with_a_shard_that_stopped_early_clears_nothing_of_earlier_runs(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    from pinrotate_core.conflicts import last_conflicts, record_conflicts

    sharded_creds(pg_conn)
    write_keys(keys_file)
    settings = custom_settings(database_url, keys_file, {"table": "creds", "columns": ["pw"], "tenant": "tenant"})
    record_conflicts(pg_conn, "T", {"a": 5}, tenant_scope=None, complete=True, run_id="earlier")

    ctx, results, _ = drain_shards(settings, pg_conn, stop_shard=1)
    try:
        assert results[1].stopped is not None and results[0].stopped is None
        merged = {"T": merge_results(results)}
        rotation.record_run_conflicts(ctx, merged, ["T"])
    finally:
        ctx.close()
    # The second shard did not see its whole range: the earlier conflicts may still stand there.
    assert last_conflicts(pg_conn, "T") >= 5
