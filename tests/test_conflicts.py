"""fpc1 CONFLICTs on real PostgreSQL: runs side by side, and the record the gate reads on any host.

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
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import rotation
from pinrotate_core.drain import Drain, DrainOptions
from pinrotate_core.errors import RefusedToStart
from pinrotate_core.gate import retire_gate
from pinrotate_core.key_checks import CREATE_SQL as KEY_CHECKS_SQL
from pinrotate_core.schemes.fpc1 import parse_fpc1
from pinrotate_core.state import CREATE_SQL, conflicts_table_exists

from .test_fpc1_migration import DC, K1, K2, LC, Forge, custom_settings, decrypt, forge_settings, fpc1, write_keys

# --- a second run in another process ----------------------------------------------------------------


def _second_run(database_url: str, keys_file: str, target: str, home: str) -> None:
    """Child process: a complete, ordinary run of ``target`` as another host would start it."""
    os.environ["PINROTATE_HOME"] = home
    report = rotation.run_rotation(forge_settings(database_url, Path(keys_file)), target_names=[target],
                                   expected_key="k2")
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
        report.targets[target] = Drain(ctx.engine, ctx.schemes[target], options).run()
        report.verified = rotation.verify(ctx, report.targets)
        report.gate = rotation.gate_report(ctx, report.targets)
        return report
    finally:
        ctx.close()


@pytest.mark.parametrize("target", [DC, LC])
def test_a_value_another_run_moved_meanwhile_is_done_not_a_conflict(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, tmp_path: Path, target: str) -> None:
    forge = Forge(pg_conn)
    write_keys(keys_file)
    settings = forge_settings(database_url, keys_file)
    seen: dict[str, Any] = {}

    def second_run_completes_first(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            seen["ids"] = list(ids)
            seen["exit"] = run_beside(database_url, keys_file, target, tmp_path / "other-host")

    report = run_with_hook(settings, target, second_run_completes_first)

    assert seen["exit"] == rotation.EXIT_OK
    result = report.targets[target]
    # Batch 1's values were moved by the other run between this run's read and write: each one a
    # compare-and-swap miss whose value is now on k2 with the same plaintext, so done, not CONFLICT.
    assert result.conflicts == 0 and result.counts.get("settled_elsewhere", 0) >= 1
    assert result.reencrypted == 0 and result.backlog_remaining == 0 and not result.failed
    assert report.exit_code == rotation.EXIT_OK
    assert report.gate["k1"]["open"] and report.gate["legacy"]["open"]
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
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, tmp_path: Path) -> None:
    forge = Forge(pg_conn)
    write_keys(keys_file)
    settings = forge_settings(database_url, keys_file)
    app_value = fpc1("k2", K2, b"a new password typed by the user")

    def other_run_then_application(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            assert run_beside(database_url, keys_file, DC, tmp_path / "other-host") == rotation.EXIT_OK
            # Same key as the other run's value, another plaintext: the application's, never ours to replace.
            pg_conn.execute("UPDATE data_connections SET password = %s WHERE id = 2", (app_value,))

    report = run_with_hook(settings, DC, other_run_then_application)

    result = report.targets[DC]
    assert result.conflicts == 1 and result.counts.get("settled_elsewhere", 0) >= 1
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED and not report.gate["k1"]["open"]
    assert forge.password(2) == app_value


# --- the record is in the database ------------------------------------------------------------------


def edit_row_2_between_read_and_write(pg_conn: psycopg.Connection[Any], value: str) -> Any:
    def hook(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            pg_conn.execute("UPDATE data_connections SET password = %s WHERE id = 2", (value,))
    return hook


def test_a_conflict_recorded_on_one_host_closes_the_gate_on_another(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    forge = Forge(pg_conn)
    write_keys(keys_file)
    settings = forge_settings(database_url, keys_file)
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    host_a.mkdir()
    host_b.mkdir()
    assert not conflicts_table_exists(pg_conn)

    monkeypatch.setenv("PINROTATE_HOME", str(host_a))
    app_value = fpc1("k2", K2, b"edited while the run ran")
    report = run_with_hook(settings, DC, edit_row_2_between_read_and_write(pg_conn, app_value))
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
    assert retire_gate(settings, "k1").open
    assert pg_conn.execute("SELECT count(*) FROM pinrotate.conflicts").fetchone() == (0,)


def test_a_run_that_stopped_early_keeps_the_larger_count_and_clears_nothing(
        database_url: str, pg_conn: psycopg.Connection[Any]) -> None:
    from pinrotate_core.state import last_conflicts, record_conflicts

    record_conflicts(pg_conn, "T", {"a": 3, "b": 1}, tenant_scope=None, complete=True, run_id="r1")
    record_conflicts(pg_conn, "T", {"a": 1, "c": 2}, tenant_scope=None, complete=False, run_id="r2")
    assert {t: last_conflicts(pg_conn, "T", tenant=t) for t in "abc"} == {"a": 3, "b": 1, "c": 2}
    record_conflicts(pg_conn, "T", {}, tenant_scope="a", complete=True, run_id="r3")  # a clean run of tenant a
    assert last_conflicts(pg_conn, "T") == 3 and last_conflicts(pg_conn, "T", tenant="a") == 0
    record_conflicts(pg_conn, "T", {"b": 4}, tenant_scope=None, complete=True, run_id="r4")
    assert last_conflicts(pg_conn, "T") == 4
    assert last_conflicts(pg_conn, "other") == 0


# --- privileges ---------------------------------------------------------------------------------------


def as_user(url: str, user: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}@{host}", parts.path, parts.query, parts.fragment))


@pytest.fixture
def app_role(pg_conn: psycopg.Connection[Any]) -> Iterator[str]:
    """A real LOGIN role, neither superuser nor owner, without CREATE on the database; dropped afterwards."""
    role = f"pinrotate_app_{secrets.token_hex(4)}"
    pg_conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        yield role
    finally:
        pg_conn.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(sql.Identifier(role)))
        pg_conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        pg_conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


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
    settings = custom_settings(as_user(database_url, app_role), keys_file, {"table": "creds", "columns": ["pw"]})

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
    assert retire_gate(settings, "k1").open


def test_a_gate_role_that_may_not_read_the_conflicts_table_is_blocked_and_an_absent_table_is_no_conflict(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, app_role: str) -> None:
    creds_table(pg_conn, app_role)
    write_keys(keys_file)
    target = {"table": "creds", "columns": ["pw"]}
    reader = custom_settings(as_user(database_url, app_role), keys_file, target)
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
