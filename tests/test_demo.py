"""`python -m flows.rotate demo`: the whole rotation from nothing, as the README's first command runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.pinprofile import cli


def _check(doc: dict[str, Any], rows: int) -> None:
    assert doc["exit_code"] == 0 and doc["current_key"] == "2"
    demo = doc["demo"]
    assert demo["rows_seeded"] == rows
    after = demo["inventory_after"]["targets"]
    assert all(t["HISTORICAL"] == 0 and t["FAILED"] == 0 for t in after.values())
    assert sum(t["ACTIVE"] for t in after.values()) + after["VerificationRequest"]["EXCLUDED"] == rows
    assert demo["gate_key_1"]["open"] is True


@pytest.mark.slow
def test_demo_rotates_sample_rows_to_key_2_and_opens_the_gate_for_key_1(prefect_api: str) -> None:
    code, doc, err = cli("demo", "--rows", "200", "--json", env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    # --rows N is N persons, as its help says: 200 persons, 100 documents, 50 templates, 50 requests.
    assert doc["demo"]["persons_seeded"] == 200
    _check(doc, 400)
    assert "demo: seeded 400 rows under key 1" in err


@pytest.mark.vault
def test_demo_with_keys_in_vault_kv(prefect_api: str, openbao: Any) -> None:
    env = {"PREFECT_API_URL": prefect_api, "VAULT_ADDR": openbao.addr, "VAULT_TOKEN": openbao.token}
    code, doc, err = cli("demo", "--rows", "100", "--keys", "vault", "--json", env=env)
    assert code == 0, err
    _check(doc, 200)
    assert "keys in Vault" in err and openbao.token not in err and openbao.token not in repr(doc)


def test_demo_refuses_a_nonsense_row_count() -> None:
    code, _, err = cli("demo", "--rows", "0")
    assert code == 2 and "--rows" in err


def test_demo_refuses_a_config_it_would_ignore_and_points_to_seed(tmp_path: Path) -> None:
    config = tmp_path / "mine.toml"
    config.write_text('[database]\nurl = "postgresql://app@db.internal/mine"\n', encoding="utf-8")
    code, _, err = cli("demo", "--config", str(config))
    assert code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("pinrotate: error:")]
    assert "seed --config" in line


def test_demo_forge_preset_rotates_forges_tables_to_k2_and_opens_the_legacy_gate(prefect_api: str) -> None:
    code, doc, err = cli("demo", "--preset", "forge", "--rows", "40", "--json", env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    assert doc["current_key"] == "k2" and doc["demo"]["preset"] == "forge"
    after = doc["demo"]["inventory_after"]["targets"]
    assert sorted(after) == ["DataConnection", "lowcode:crm_customer"]  # discovered from Forge's metadata
    assert all(t["HISTORICAL"] == t["LEGACY"] == t["FAILED"] == t["UNKNOWN"] == 0 for t in after.values())
    assert after["lowcode:crm_customer"]["ACTIVE"] == 70  # 40 phones, 30 id cards
    assert doc["demo"]["gate_legacy"]["open"] is True
    assert "demo: seeded" in err
