"""Forge on its own MariaDB, end to end through the CLI (contract §2 fpc1, §3 [forge], §4, §6):
examples/forge-mysql.sql and examples/forge-mysql.toml as a Forge operator uses them, Forge's
tables discovered from ai_crud_config, values made and read back by the tests' own Forge codec.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from tests.mariadb_server import MariaDbServer

from .codecs import forge_reads
from .forge_data import CATEGORIES, SEEDED_AT, TABLES, ForgeInstall, install_forge
from .support import connect, rotate

pytestmark = pytest.mark.mysql

TARGETS = ("DataConnection", "lowcode:crm_customer")
SEEDED = dt.datetime.fromisoformat(SEEDED_AT)


@pytest.fixture
def forge(mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> ForgeInstall:
    return install_forge(mariadb, mysql_database, tmp_path)


def config(forge: ForgeInstall) -> tuple[str, str]:
    return ("--config", str(forge.config))


def positive(blocking: dict[str, int]) -> dict[str, int]:
    return {k: n for k, n in blocking.items() if n}


def gate(forge: ForgeInstall, key: str, *extra: str) -> tuple[int, dict[str, Any]]:
    code, doc, err = rotate("gate", "--retire", key, *extra, *config(forge), "--json")
    assert code in (0, 3), err
    assert doc["key"] == key and doc["open"] is (code == 0), doc
    return code, doc


def test_forge_inventory_on_mariadb_counts_every_value_as_forge_classifies_it(forge: ForgeInstall) -> None:
    before = forge.snapshot()
    code, doc, err = rotate("inventory", *config(forge), "--json")
    assert code == 0, err
    assert doc["current_key"] == forge.active
    # Discovered from ai_crud_config: crm_customer's fields; '{}' and NULL encrypt_config add nothing.
    assert sorted(doc["targets"]) == sorted(TARGETS)
    for target in TARGETS:
        assert {c: doc["targets"][target][c] for c in CATEGORIES} == forge.counts(target), target
    assert forge.counts("DataConnection")["LEGACY"] == 2 and forge.counts("DataConnection")["HISTORICAL"] == 4

    code, deep, err = rotate("inventory", "--deep", *config(forge), "--json")
    assert code == 0, err
    for target in TARGETS:  # every value decrypts: none FAILED, the other counts the same
        assert {c: deep["targets"][target][c] for c in CATEGORIES} == forge.counts(target), target
    assert forge.snapshot() == before


def test_forge_dry_run_on_mariadb_reports_what_a_run_would_move_and_writes_nothing(
        forge: ForgeInstall, prefect_api: str) -> None:
    before = forge.snapshot()
    code, doc, err = rotate("run", "--dry-run", "--expected-key-version", forge.active, *config(forge), "--json",
                            prefect_api=prefect_api)
    assert code == 0, err
    assert doc["dry_run"] is True and doc["current_key"] == forge.active
    for target in TARGETS:
        report = doc["targets"][target]
        assert (report["reencrypted"], report["failed"], report["conflicts"]) == (forge.moved(target), 0, 0), target
    assert forge.snapshot() == before


def test_forge_run_on_mariadb_moves_legacy_and_historical_values_to_the_active_key_keeping_update_time(
        forge: ForgeInstall, prefect_api: str) -> None:
    before = forge.snapshot()
    code, doc, err = rotate("run", "--expected-key-version", forge.active, *config(forge), "--json",
                            prefect_api=prefect_api)
    assert code == 0, err
    assert doc["dry_run"] is False and doc["current_key"] == forge.active
    for target in TARGETS:
        report = doc["targets"][target]
        assert (report["reencrypted"], report["failed"], report["conflicts"], report["backlog_remaining"]) == \
            (forge.moved(target), 0, 0, 0), target

    after = forge.snapshot()
    active_only = {forge.active: forge.keys[forge.active]}
    for v in forge.values:
        stored = after[v.table][v.row][v.column]
        if v.moves:  # what Forge's reencrypt writes: FPC1:<its own algorithm, upper case>:<active>:<base64>
            assert forge_reads(stored, active_only) == (v.algorithm, forge.active, v.plaintext), (v.table, v.row, v.column)
        else:  # active, unknown, soft-deleted, NULL and blank: byte for byte as they were
            assert stored == v.stored, (v.table, v.row, v.column, v.kind)
    for table, rows in before.items():
        cipher = TABLES[table][1] if table in TABLES else ()
        for row_id, row in rows.items():
            kept = {k: x for k, x in after[table][row_id].items() if k not in cipher}
            assert kept == {k: x for k, x in row.items() if k not in cipher}, (table, row_id)
    for table in TABLES:  # ON UPDATE CURRENT_TIMESTAMP did not fire
        assert {row["update_time"] for row in after[table].values()} == {SEEDED}, table

    code, inv, err = rotate("inventory", *config(forge), "--json")
    assert code == 0, err
    for target in TARGETS:
        counts = forge.counts(target)
        assert (inv["targets"][target]["LEGACY"], inv["targets"][target]["HISTORICAL"]) == (0, 0)
        assert inv["targets"][target]["ACTIVE"] == counts["ACTIVE"] + forge.moved(target)
    code, again, err = rotate("run", "--expected-key-version", forge.active, *config(forge), "--json",
                              prefect_api=prefect_api)
    assert code == 0, err
    assert {t: again["targets"][t]["reencrypted"] for t in TARGETS} == dict.fromkeys(TARGETS, 0)
    assert forge.snapshot() == after


@pytest.mark.server_wide  # its gates sweep the whole server (tests/conftest.py, Parallel runs)
def test_forge_retire_gates_on_mariadb_are_closed_before_the_run_and_open_once_nothing_is_on_the_key(
        forge: ForgeInstall, prefect_api: str) -> None:
    live_legacy = sum(v.category == "LEGACY" for v in forge.values)
    historical = sum(v.category == "HISTORICAL" for v in forge.values)
    code, doc = gate(forge, "legacy")
    assert code == 3 and doc["blocking"]["LEGACY"] == live_legacy
    code, doc = gate(forge, forge.old)
    assert code == 3 and doc["blocking"]["HISTORICAL"] == historical

    code, _, err = rotate("run", "--expected-key-version", forge.active, *config(forge), "--json",
                          prefect_api=prefect_api)
    assert code == 0, err
    # The value Forge cannot classify (FPC1:AES-GCM:...) keeps every gate closed until a person
    # handles it: it could be hiding anything.
    code, doc = gate(forge, forge.old)
    assert code == 3 and positive(doc["blocking"]) == {"UNKNOWN": 1}
    with connect(forge.server, forge.database) as conn, conn.cursor() as cur:
        cur.execute("UPDATE ai_report_data_connection SET password_cipher = NULL WHERE id = 12")

    code, doc = gate(forge, forge.old)
    assert code == 0 and positive(doc["blocking"]) == {}
    # The soft-deleted connection still holds a legacy value: destroying the legacy key erases it,
    # which the operator must acknowledge.
    code, doc = gate(forge, "legacy")
    assert code == 3 and positive(doc["blocking"]) == {"EXCLUDED": 1}
    code, doc = gate(forge, "legacy", "--erase-excluded")
    assert code == 0 and doc["open"] is True
    deleted = next(v for v in forge.values if v.table == "ai_report_data_connection" and v.row == 11)
    assert forge.rows("ai_report_data_connection")[1][11]["password_cipher"] == deleted.stored
