"""pinrotate's own bookkeeping on MySQL / MariaDB (contract §4, §6 "Key identity", CONFLICT): the
``pinrotate`` database of the server, with ``key_checks`` and ``conflicts`` rows per database, on the
real MariaDB. Runs record, inventories and gates read, and what cannot be read closes (fail closed).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest

from pinrotate_core.commands.mysql.bookkeeping import (
    confirm_key_identity_mysql,
    last_conflicts_mysql,
    record_conflicts_mysql,
)
from pinrotate_core.config import load_settings
from pinrotate_core.engines.mysql.connect import MySqlConnection
from pinrotate_core.errors import RefusedToStart
from pinrotate_core.key_checks import KeyIdentityMismatch
from pinrotate_core.providers import build_provider
from pinrotate_core.rotation import run_rotation
from pinrotate_core.schemes.fpc1 import Fpc1Scheme
from tests.mariadb_server import MariaDbServer
from tests.mysql_contract.codecs import forge_fpc1
from tests.mysql_contract.forge_data import ForgeInstall, install_forge
from tests.mysql_contract.support import connect, forge_bootstrap, one_line_error, query, rotate
from tests.prefect_reads import recorded_task_runs

pytestmark = pytest.mark.mysql

KEY_CHECK_LABEL = b"pinrotate key check value v1"  # docs/reference.md: HMAC-SHA256 over it, first 128 bits


def independent_check_value(material: bytes) -> str:
    """The check value as the reference describes it, computed without pinrotate."""
    return hmac.new(material, KEY_CHECK_LABEL, hashlib.sha256).digest()[:16].hex()


def bookkeeping(server: MariaDbServer, table: str, database: str) -> list[tuple[Any, ...]]:
    with connect(server, None) as conn:
        try:
            if table == "key_checks":
                return query(conn, "SELECT key_id, check_value, algorithm, recorded_by FROM pinrotate.key_checks"
                                   " WHERE database_name = %s ORDER BY key_id", (database,))
            return query(conn, "SELECT target, tenant, conflicts FROM pinrotate.conflicts WHERE database_name = %s"
                               " ORDER BY target, tenant", (database,))
        except pymysql.err.ProgrammingError:  # no such table yet
            return []


@pytest.fixture
def forge(mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> Iterator[ForgeInstall]:
    install = install_forge(mariadb, mysql_database, tmp_path)
    yield install
    with connect(mariadb, None) as conn:  # the server's one pinrotate database outlives the test's
        for table in ("key_checks", "conflicts"):
            try:
                query(conn, f"DELETE FROM pinrotate.{table} WHERE database_name = %s", (mysql_database,))
            except pymysql.err.ProgrammingError:
                pass


def other_keyring_config(forge: ForgeInstall, tmp_path: Path) -> Path:
    """The same configuration with another host's Forge keyring: same key ids, other material under
    the old one."""
    other = dict(forge.keys)
    other[forge.old] = secrets.token_bytes(16)
    text = forge.config.read_text(encoding="utf-8")
    bootstrap = forge_bootstrap(tmp_path / "other" / "crypto.properties", forge.active, other, forge.legacy)
    other_cfg = tmp_path / "other.toml"
    other_cfg.write_text(text.replace(str(forge.config.parent / "forge" / "crypto.properties"), str(bootstrap)),
                         encoding="utf-8")
    assert str(bootstrap) in other_cfg.read_text(encoding="utf-8")
    return other_cfg


def test_a_run_records_each_keys_check_value_and_other_material_under_a_key_id_is_refused(
        forge: ForgeInstall, tmp_path: Path, prefect_api: str) -> None:
    cfg = ("--config", str(forge.config))
    code, doc, err = rotate("run", "--dry-run", *cfg, "--json", prefect_api=prefect_api)
    assert code == 0, err
    assert bookkeeping(forge.server, "key_checks", forge.database) == []  # a dry run only compares

    code, doc, err = rotate("run", "--expected-key-version", forge.active, *cfg, "--json", prefect_api=prefect_api)
    assert code == 0, err
    rows = {r[0]: r[1:] for r in bookkeeping(forge.server, "key_checks", forge.database)}
    expected = {forge.active: forge.keys[forge.active], forge.old: forge.keys[forge.old]}
    assert set(expected) <= set(rows)
    for key_id, material in expected.items():
        value, algorithm, by = rows[key_id]
        assert value == independent_check_value(material) and algorithm == "hmac-sha256-128:v1", key_id
        assert by.endswith(f"run {doc['run_id']}")
        assert material.hex() not in value
    assert any(v == independent_check_value(forge.legacy) for v, _, _ in rows.values())  # the legacy key too
    for note in doc["targets"]["DataConnection"].get("notes", []):
        assert "key check" not in note and "CONFLICT" not in note, note

    # Another host's keyring: same key ids, other material under the old one.
    other_cfg = other_keyring_config(forge, tmp_path)
    before = forge.snapshot()
    for args in (["run", "--expected-key-version", forge.active], ["run", "--dry-run"], ["gate", "--retire", forge.old, "--shallow"]):
        code, out, err = rotate(*args, "--config", str(other_cfg), "--json")
        line = one_line_error(code, out, err, expected=2)
        assert forge.old in line and "pinrotate.key_checks" in line, (args, line)
    assert forge.snapshot() == before
    assert {r[0]: r[1:] for r in bookkeeping(forge.server, "key_checks", forge.database)} == rows

    # The same keyring in another database of the same server is another database's business.
    settings = load_settings(forge.config)
    with connect(forge.server, None) as conn:
        query(conn, f"CREATE DATABASE `{forge.database}_2`")
    try:
        url = forge.server.url(f"{forge.database}_2")
        bare = settings.model_copy(update={"database": settings.database.model_copy(update={"url": url})})
        from pinrotate_core.db import make_engine
        from pinrotate_core.engines.mysql.connect import raw_connection
        engine = make_engine(url, pool_size=1)
        try:
            with raw_connection(engine) as conn:
                keyring = build_provider(bare).load_keyring()
                identity = confirm_key_identity_mysql(conn, bare, keyring, build_provider(bare), record=False)
        finally:
            engine.dispose()
        assert identity.compared == {} and forge.old in identity.not_recorded
    finally:
        with connect(forge.server, None) as conn:
            query(conn, f"DROP DATABASE `{forge.database}_2`")


def test_conflict_records_keep_completed_and_partial_runs_apart_per_database_and_tenant(
        my_conn: MySqlConnection, mysql_database: str, mariadb: MariaDbServer) -> None:
    try:
        assert last_conflicts_mysql(my_conn, "T") == 0
        record_conflicts_mysql(my_conn, "T", {"1": 2, "2": 1}, tenant_scope=None, complete=True, run_id="r1")
        assert (last_conflicts_mysql(my_conn, "T"), last_conflicts_mysql(my_conn, "T", tenant="1")) == (3, 2)
        # A run that stopped early clears nothing and keeps the larger count.
        record_conflicts_mysql(my_conn, "T", {"1": 1}, tenant_scope=None, complete=False, run_id="r2")
        assert bookkeeping(mariadb, "conflicts", mysql_database) == [("T", "1", 2), ("T", "2", 1)]
        # A complete run of one tenant replaces only that tenant's.
        record_conflicts_mysql(my_conn, "T", {}, tenant_scope="2", complete=True, run_id="r3")
        assert bookkeeping(mariadb, "conflicts", mysql_database) == [("T", "1", 2)]
        # Another database of the server does not see them.
        assert bookkeeping(mariadb, "conflicts", mysql_database + "_none") == []
        # Shards of one run add up and clear nothing; against an earlier run's count, the larger.
        record_conflicts_mysql(my_conn, "T", {"1": 1}, tenant_scope=None, complete=True, run_id="r5", shard=True)
        assert bookkeeping(mariadb, "conflicts", mysql_database) == [("T", "1", 2)]
        record_conflicts_mysql(my_conn, "T", {"1": 1, "3": 1}, tenant_scope=None, complete=True, run_id="r5",
                               shard=True)
        assert bookkeeping(mariadb, "conflicts", mysql_database) == [("T", "1", 3), ("T", "3", 1)]
        record_conflicts_mysql(my_conn, "T", {}, tenant_scope=None, complete=True, run_id="r4")
        assert last_conflicts_mysql(my_conn, "T") == 0
    finally:
        with my_conn.cursor() as cur:
            cur.execute("DELETE FROM pinrotate.conflicts WHERE database_name = %s", (mysql_database,))


def _edit_during_first_batch(monkeypatch: pytest.MonkeyPatch, forge: ForgeInstall, row: int) -> str:
    """The application rewrites connection ``row``'s password (under the active key) after the run
    read its batch and before it writes: the run's compare-and-swap must leave it (CONFLICT)."""
    plan = Fpc1Scheme.plan
    done: list[bool] = []
    new_value = forge_fpc1("SM4", forge.active, forge.keys[forge.active], "set by the application")

    def edited_plan(self: Fpc1Scheme, rows: Any, known_failed: Any = ()) -> Any:
        if not done and self.target.name == "DataConnection" and any(r[0] == row for r in rows):
            done.append(True)
            with connect(forge.server, forge.database) as app:
                query(app, "UPDATE ai_report_data_connection SET password_cipher = %s WHERE id = %s", (new_value, row))
        return plan(self, rows, known_failed)

    monkeypatch.setattr(Fpc1Scheme, "plan", edited_plan)
    return new_value


def test_a_conflict_is_recorded_counted_by_inventory_and_cleared_by_a_clean_run(
        forge: ForgeInstall, monkeypatch: pytest.MonkeyPatch) -> None:
    new_value = _edit_during_first_batch(monkeypatch, forge, row=3)
    settings = load_settings(forge.config)
    report = run_rotation(settings, target_names=["DataConnection"], expected_key=forge.active)
    r = report.targets["DataConnection"]
    assert r.conflicts == 1 and r.conflicts_by_tenant == {"1": 1} and report.exit_code == 4
    assert forge.rows("ai_report_data_connection")[1][3]["password_cipher"] == new_value  # the edit stands
    assert bookkeeping(forge.server, "conflicts", forge.database) == [("DataConnection", "1", 1)]
    code, doc, err = rotate("inventory", "--config", str(forge.config), "--json")
    assert code == 0 and doc["targets"]["DataConnection"]["CONFLICT"] == 1, err
    code, doc, err = rotate("inventory", "--tenant", "2", "--config", str(forge.config), "--json")
    assert code == 0 and doc["targets"]["DataConnection"]["CONFLICT"] == 0, err

    monkeypatch.undo()
    report = run_rotation(settings, target_names=["DataConnection"], expected_key=forge.active)
    assert report.targets["DataConnection"].conflicts == 0 and report.exit_code == 0
    assert bookkeeping(forge.server, "conflicts", forge.database) == []
    code, doc, err = rotate("inventory", "--config", str(forge.config), "--json")
    assert code == 0 and doc["targets"]["DataConnection"]["CONFLICT"] == 0, err


@pytest.mark.server_wide  # the gate sweeps the whole server (tests/conftest.py, Parallel runs)
def test_the_gate_sees_a_recorded_conflict_and_a_role_that_cannot_read_the_records_is_blocked(
        forge: ForgeInstall, monkeypatch: pytest.MonkeyPatch) -> None:
    _edit_during_first_batch(monkeypatch, forge, row=3)
    assert run_rotation(load_settings(forge.config), target_names=["DataConnection"], expected_key=forge.active).exit_code == 4
    code, doc, err = rotate("gate", "--retire", forge.old, "--config", str(forge.config), "--json")
    assert code == 3, err
    assert doc["blocking"]["CONFLICT"] == 1 and doc["targets"]["DataConnection"]["blocking"].get("CONFLICT") == 1
    assert doc["key_identity"]["recorded"] is True and doc["key_identity"]["table"] == "pinrotate.key_checks"

    # A role that reads the application's tables but not pinrotate.conflicts: the target is
    # BLOCKED (the conflicts it cannot see might exist), never counted as none.
    user, password = f"ro_{secrets.token_hex(4)}", secrets.token_hex(8)
    with connect(forge.server, None) as root:
        query(root, f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'")
        query(root, f"GRANT SELECT ON `{forge.database}`.* TO '{user}'@'%'")
    try:
        text = forge.config.read_text(encoding="utf-8")
        url = forge.server.url(forge.database)
        limited = url.replace(f"{forge.server.user}@", f"{user}:{password}@", 1)
        assert limited != url
        cfg = forge.config.parent / "limited.toml"
        cfg.write_text(text.replace(url, limited), encoding="utf-8")
        code, doc, err = rotate("inventory", "--config", str(cfg), "--json")
        assert code == 0, err
        target = doc["targets"]["DataConnection"]
        assert target["BLOCKED"] >= 1 and target["CONFLICT"] == 0, target
        assert "pinrotate.conflicts" in target["blocked_reason"] and "GRANT SELECT" in target["blocked_reason"], target
    finally:
        with connect(forge.server, None) as root:
            query(root, f"DROP USER IF EXISTS '{user}'@'%'")


def test_a_role_that_may_not_create_the_bookkeeping_is_refused_before_writing(
        forge: ForgeInstall) -> None:
    """No pinrotate database rights at all: a run stops before its first write, naming the grant."""
    user, password = f"rw_{secrets.token_hex(4)}", secrets.token_hex(8)
    with connect(forge.server, None) as root:
        query(root, f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'")
        query(root, f"GRANT SELECT, UPDATE ON `{forge.database}`.* TO '{user}'@'%'")
    try:
        url = forge.server.url(forge.database)
        settings = load_settings(forge.config)
        limited = url.replace(f"{forge.server.user}@", f"{user}:{password}@", 1)
        bare = settings.model_copy(update={"database": settings.database.model_copy(update={"url": limited})})
        before = forge.snapshot()
        with pytest.raises(RefusedToStart) as refused:
            run_rotation(bare, expected_key=forge.active)
        assert "GRANT" in str(refused.value) and "pinrotate." in str(refused.value)
        assert not isinstance(refused.value, KeyIdentityMismatch)
        assert forge.snapshot() == before
    finally:
        with connect(forge.server, None) as root:
            query(root, f"DROP USER IF EXISTS '{user}'@'%'")


def test_the_reference_prints_the_bookkeeping_ddl_the_room_runs() -> None:
    """docs/reference.md's MySQL DDL is what pinrotate (and ``grants``) runs, word for word."""
    import re

    from pinrotate_core.engines.mysql.grants import bookkeeping_ddl
    from tests.pinprofile import REPO

    text = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    section = text.split("### On MySQL / MariaDB: the `pinrotate` database", 1)[1].split("```sql", 1)[1]
    printed = [re.sub(r"\s+", " ", s).replace("( ", "(").strip() for s in section.split("```", 1)[0].split(";")]
    ours = [re.sub(r"\s+", " ", s).replace("( ", "(").strip() for s in bookkeeping_ddl()]
    assert [s for s in printed if s] == ours


def test_a_drain_stopped_at_the_run_deadline_says_deadline_and_clears_no_earlier_conflict(
        forge: ForgeInstall) -> None:
    """A drain that did not see its whole target (job.max_run_duration passed) is stopped as
    ``deadline`` between batches, and its record clears nothing an earlier run left."""
    from pinrotate_core import rotation
    from pinrotate_core.drain import STOP_DEADLINE

    with connect(forge.server, forge.database) as conn:
        record_conflicts_mysql(conn, "DataConnection", {"1": 3}, tenant_scope=None, complete=True, run_id="earlier")
    before = forge.snapshot()
    ctx = rotation.open_run(load_settings(forge.config), target_names=["DataConnection"], expected_key=forge.active)
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        ctx.started -= ctx.settings.job.max_run_duration + 1  # the run's deadline has passed
        result = rotation.drain(ctx, "DataConnection")
    finally:
        ctx.close()
    assert (result.stopped, result.reencrypted, result.state_error) == (STOP_DEADLINE, 0, None), result
    assert result.backlog_remaining > 0
    assert forge.snapshot() == before
    assert bookkeeping(forge.server, "conflicts", forge.database) == [("DataConnection", "1", 3)]


# --- through the Prefect flow (the run's own steps, not the CLI's check before it) ---------------------


def test_a_run_through_the_flow_refuses_other_material_under_a_recorded_key_id_and_writes_nothing(
        forge: ForgeInstall, tmp_path: Path, prefect_api: str) -> None:
    """The flow's read_current_key task compares (and records) the keys before any drain: called
    here without the CLI's check before Prefect starts, it alone must refuse another host's keyring."""
    from flows.flow import run_flow
    from pinrotate_core import rotation

    ctx = rotation.open_run(load_settings(forge.config), expected_key=forge.active)
    try:
        rotation.read_current_key(ctx, announce=False)  # the flow's first step of a run that writes: records
        run_id = ctx.run_id
    finally:
        ctx.close()
    rows = {r[0]: r[1:] for r in bookkeeping(forge.server, "key_checks", forge.database)}
    assert rows[forge.old][0] == independent_check_value(forge.keys[forge.old])
    assert rows[forge.old][2].endswith(f"run {run_id}")

    before = forge.snapshot()
    outcome = run_flow(config_path=str(other_keyring_config(forge, tmp_path)), expected_key_version=forge.active)
    assert outcome.exit_code == 2 and outcome.report is None, outcome
    assert outcome.error is not None and forge.old in outcome.error and "pinrotate.key_checks" in outcome.error
    assert forge.snapshot() == before  # nothing written
    assert {r[0]: r[1:] for r in bookkeeping(forge.server, "key_checks", forge.database)} == rows


SHARDED_ROWS = 120  # two shards of MIN_BATCHES_PER_SHARD (25) batches of 2


@pytest.mark.server_wide  # the run's gate sweeps every database of the server (tests/conftest.py, Parallel runs)
def test_a_sharded_fpc1_run_through_the_flow_records_its_conflicts_once_replacing_an_earlier_runs(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path, prefect_api: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two shards, an application edit in each: each shard adds its CONFLICT (clearing nothing of its
    sibling's), and once both have ended the run records its total, once: 2, not the sum of the
    shards' records and the total, and not an earlier run's 5 kept beside it."""
    from flows.flow import run_flow
    from tests.mysql_contract.support import file_keyring, write_toml

    active, old = f"act{secrets.token_hex(5)}", f"old{secrets.token_hex(5)}"
    keys = {active: secrets.token_bytes(16), old: secrets.token_bytes(16)}
    with connect(mariadb, mysql_database) as conn:
        query(conn, "CREATE TABLE creds (id bigint PRIMARY KEY, tenant varchar(20) NOT NULL, pw varchar(500) NULL)"
                    " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO creds VALUES (%s, 'a', %s)",
                            [(i, forge_fpc1("SM4", old, keys[old], f"password {i}")) for i in range(1, SHARDED_ROWS + 1)])
        record_conflicts_mysql(conn, "Creds", {"a": 5}, tenant_scope=None, complete=True, run_id="earlier")
    cfg = write_toml(tmp_path / "pinrotate.toml", {
        "database": {"url": mariadb.url(mysql_database)},
        "keys": {"provider": "file", "file": str(file_keyring(tmp_path / "keys" / "keys.toml", active, keys)),
                 "write_versioned": True},
        "job": {"batch_size": 2, "inter_batch_delay": 0, "max_degree_of_parallelism": 1},  # threads: one process
        "targets": [{"name": "Creds", "table": "creds", "id": "id", "columns": ["pw"], "format": "fpc1",
                     "tenant": "tenant"}],
    })

    # The application rewrites row 1 (the first shard's first batch) and row 120 (the second shard's
    # last batch) after the run read them and before it writes.
    plan = Fpc1Scheme.plan
    edited: set[int] = set()

    def edited_plan(self: Fpc1Scheme, rows: Any, known_failed: Any = ()) -> Any:
        for row_id in {1, SHARDED_ROWS} - edited:
            if any(r[0] == row_id for r in rows):
                edited.add(row_id)
                with connect(mariadb, mysql_database) as app:
                    query(app, "UPDATE creds SET pw = %s WHERE id = %s",
                          (forge_fpc1("SM4", active, keys[active], "typed by the user"), row_id))
        return plan(self, rows, known_failed)

    monkeypatch.setattr(Fpc1Scheme, "plan", edited_plan)
    outcome = run_flow(config_path=str(cfg), expected_key_version=active)
    report = outcome.report
    assert report is not None, outcome
    run_id = report["run_id"]
    assert edited == {1, SHARDED_ROWS}
    creds = report["targets"]["Creds"]
    assert (creds["reencrypted"], creds["conflicts"], creds["backlog_remaining"]) == (SHARDED_ROWS - 2, 2, 0), creds
    assert outcome.exit_code == 4  # a CONFLICT is fail-closed

    names = {t.name for t in recorded_task_runs(run_id)}
    assert {"drain-Creds-1/2", "drain-Creds-2/2"} <= names, names  # it was sharded
    # The run's total, recorded once both shards ended: the earlier run's 5 replaced, nothing doubled.
    assert bookkeeping(mariadb, "conflicts", mysql_database) == [("Creds", "a", 2)]
    assert report["gate"][old]["open"] is False and report["gate"][old]["blocking"].get("CONFLICT") == 2, report["gate"]
    code, doc, err = rotate("inventory", "--config", str(cfg), "--json")
    assert code == 0 and doc["targets"]["Creds"]["CONFLICT"] == 2, err
