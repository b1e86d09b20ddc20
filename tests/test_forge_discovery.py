"""Forge's own tables as targets (``[forge] discover_targets = true``, contract §3), on real
PostgreSQL with examples/forge.sql. Values are made by the test's own Forge encryptor
(tests/test_forge_rules.py), TEST KEYS ONLY.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.errors import ConfigError
from pinrotate_core.forge_discovery import snake_case, with_forge_targets
from pinrotate_core.gate import retire_gate
from pinrotate_core.gate.discover import discover
from pinrotate_core.grants import grant_statements

from .test_forge_rules import ACTIVE_1, ACTIVE_2, LEGACY_KEY, bootstrap, forge_encrypt, forge_reads

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def settings(database_url: str, tmp_path: Path, **extra: Any) -> Settings:
    return settings_from_mapping({
        "database": {"url": database_url},
        "keys": {"provider": "forge", "file": str(bootstrap(tmp_path / "crypto.properties", legacy=LEGACY_KEY))},
        "forge": {"discover_targets": True},
        "job": {"batch_size": 50, "inter_batch_delay": 0},
        **extra,
    }, env={})


def load_forge(conn: psycopg.Connection[Any]) -> None:
    conn.execute((EXAMPLES / "forge.sql").read_text(encoding="utf-8"))
    conn.execute("INSERT INTO ai_report_data_connection (id, connection_code, connection_name, password_cipher, del_flag)"
                 " VALUES (1, 'a', 'A', %s, '0'), (2, 'b', 'B', %s, '0'), (3, 'c', 'C', %s, '1')",
                 (forge_encrypt("SM4", LEGACY_KEY, "pw-a"), "FPC1:SM4:k1:" + forge_encrypt("SM4", ACTIVE_1, "pw-b"),
                  forge_encrypt("SM4", LEGACY_KEY, "pw-deleted")))
    conn.execute("INSERT INTO ai_crud_config (id, config_key, table_name, encrypt_config) VALUES "
                 "(1, 'crm_customer', 'crm_customer', %s), (2, 'no_crypto', 'crm_customer', '{}'), "
                 "(3, 'null_crypto', 'crm_customer', NULL)",
                 (json.dumps({"phone": {"algorithm": "SM4"}, "idCard": {"algorithm": "aes"}}),))
    conn.execute("INSERT INTO crm_customer (id, tenant_id, name, phone, id_card) VALUES (1, 1, 'x', %s, %s), "
                 "(2, 2, 'y', %s, NULL)",
                 (forge_encrypt("SM4", LEGACY_KEY, "13800000000"), forge_encrypt("AES", LEGACY_KEY, "110101199001011234"),
                  "FPC1:SM4:k1:" + forge_encrypt("SM4", ACTIVE_1, "13900000000")))


@pytest.mark.parametrize(("field", "column"), [("phone", "phone"), ("idCard", "id_card"),
                                               ("userIDCard", "user_id_card"), ("bankCardNo2", "bank_card_no2")])
def test_camel_case_fields_map_to_snake_case_columns_as_forge_maps_them(field: str, column: str) -> None:
    assert snake_case(field) == column


def test_discovered_targets_are_inventoried_rotated_and_gated_like_configured_ones(
        database_url: str, pg_conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    load_forge(pg_conn)
    s = settings(database_url, tmp_path)
    found = {t.name: t for t in with_forge_targets(s).targets}
    assert sorted(found) == ["DataConnection", "lowcode:crm_customer"]
    crm = found["lowcode:crm_customer"]
    assert (crm.table, crm.columns, crm.tenant, crm.soft_delete) == ("crm_customer", ("phone", "id_card"), "tenant_id",
                                                                     "del_flag")
    assert crm.legacy_algorithm == {"phone": "SM4", "id_card": "AES"}

    inv = rotation.inventory(s).targets
    assert (inv["DataConnection"].counts["LEGACY"], inv["DataConnection"].counts["HISTORICAL"]) == (1, 1)
    assert inv["DataConnection"].counts["EXCLUDED"] == 1  # del_flag = '1'
    assert (inv["lowcode:crm_customer"].counts["LEGACY"], inv["lowcode:crm_customer"].counts["HISTORICAL"]) == (2, 1)

    report = rotation.run_rotation(s, expected_key="k2")
    assert report.exit_code == 0
    assert report.targets["DataConnection"].reencrypted == 2 and report.targets["lowcode:crm_customer"].reencrypted == 3
    keys = {"k2": ACTIVE_2}
    row = pg_conn.execute("SELECT phone, id_card FROM crm_customer WHERE id = 1").fetchone()
    assert row is not None
    assert forge_reads(row[0], keys) == ("SM4", "k2", "13800000000")
    assert forge_reads(row[1], keys) == ("AES", "k2", "110101199001011234")
    assert retire_gate(s, "legacy", erase_excluded=True).open

    # A low-code config added after the run: its legacy values are inside the next gate.
    pg_conn.execute("CREATE TABLE hr_employee (id bigint PRIMARY KEY, tenant_id bigint, bank_card varchar(255),"
                    " del_flag char(1) NOT NULL DEFAULT '0')")
    pg_conn.execute("INSERT INTO hr_employee VALUES (1, 1, %s, '0')", (forge_encrypt("SM4", LEGACY_KEY, "6222"),))
    pg_conn.execute("INSERT INTO ai_crud_config (id, config_key, table_name, encrypt_config) VALUES "
                    "(4, 'hr_employee', 'hr_employee', '{\"bankCard\": {\"algorithm\": \"SM4\"}}')")
    gate = retire_gate(s, "legacy", erase_excluded=True)
    assert not gate.open and gate.blocking.get("LEGACY") == 1
    assert "lowcode:hr_employee" in gate.targets
    again = rotation.run_rotation(s, expected_key="k2", target_names=["lowcode:hr_employee"])
    assert again.exit_code == 0 and again.targets["lowcode:hr_employee"].reencrypted == 1
    assert retire_gate(s, "legacy", erase_excluded=True).open
    # The sweep outside the targets (inventory --discover) sees Forge's tables as targets, not as finds.
    assert not [f.column for f in discover(s).finds if "crm_customer" in f.column or "data_connection" in f.column]
    # grants name the discovered tables too.
    assert any("crm_customer" in line and "UPDATE" in line for line in grant_statements(s, "rotator"))


def test_a_discovered_table_or_column_that_is_missing_is_blocked_and_keeps_the_gate_closed(
        database_url: str, pg_conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    load_forge(pg_conn)
    pg_conn.execute("INSERT INTO ai_crud_config (id, config_key, table_name, encrypt_config) VALUES "
                    "(5, 'gone', 'no_such_table', '{\"phone\": {}}'), "
                    "(6, 'crm_extra', 'crm_customer', '{\"mobilePhone\": {\"algorithm\": \"SM4\"}}')")
    s = settings(database_url, tmp_path)
    inv = rotation.inventory(s).targets
    assert inv["lowcode:gone"].counts["BLOCKED"] == 1 and inv["lowcode:crm_extra"].counts["BLOCKED"] == 1
    gate = retire_gate(s, "legacy", erase_excluded=True)
    assert not gate.open and gate.blocking["BLOCKED"] == 2


def test_an_encrypt_config_forge_cannot_read_stops_the_start_naming_it(
        database_url: str, pg_conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    load_forge(pg_conn)
    pg_conn.execute("INSERT INTO ai_crud_config (id, config_key, table_name, encrypt_config) VALUES "
                    "(7, 'odd', 'crm_customer', '{\"phone\": {\"algorithm\": \"DES\"}}')")
    with pytest.raises(ConfigError, match="'odd'.*field 'phone': algorithm must be SM4 or AES"):
        rotation.inventory(settings(database_url, tmp_path))
