"""Operations: nothing secret leaves the process, and the optional single-instance guard."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import psycopg
import pytest

from pinrotate_core.rotation import LOCK_NAME
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from tests.pinprofile import cli, seed_profile, write_config


def test_a_second_run_exits_0_at_once_while_another_holds_the_single_instance_lock(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=30, single_instance=True)
    with psycopg.connect(primary_database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (LOCK_NAME,))
        code, doc, err = cli("run", "--config", str(profile.config_path), "--json",
                             env={"PREFECT_API_URL": prefect_api})
        assert code == 0, err
        assert LOCK_NAME in doc["skipped"]
        assert doc["targets"] == {}
        assert profile.key_versions("persons") == {1: 30}
    code, doc, err = cli("run", "--config", str(profile.config_path), "--json", env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    assert doc["targets"]["Person"]["reencrypted"] == 30


@pytest.mark.slow
def test_no_plaintext_key_or_ciphertext_appears_in_output_logs_artifacts_or_report(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    profile = seed_profile(primary_database_url, tmp_path, rows=0, batch_size=7, inter_batch_delay=0)
    ring = profile.provider().load_keyring()
    old = AesGcmCipherSet(type(ring)(current="1", keys=ring.keys, source="test"))
    markers: list[str] = []
    stored: list[bytes] = []
    with psycopg.connect(primary_database_url) as conn:
        for i in range(40):
            values = []
            for field in ("first", "last", "middle", "birth"):
                marker = f"MARKER-{field}-{uuid.uuid4().hex}"
                markers.append(marker)
                values.append(old.encrypt_current(marker.encode()))
            if i == 13:  # one corrupt row: reported as FAILED by id and column, never by value
                values[0] = values[0][:-1] + bytes([values[0][-1] ^ 1])
            stored += values
            conn.execute(
                "INSERT INTO profile.persons (id, first_name_cipher, last_name_cipher, middle_name_cipher,"
                " birth_date_cipher, key_version, version, updated_at) VALUES (%s, %s, %s, %s, %s, 1, 1, now())",
                (uuid.uuid4(), *values))
    secrets = markers + [base64.b64encode(k.material).decode() for k in ring.keys.values()]
    secrets += [k.material.hex() for k in ring.keys.values()]
    secrets += [base64.b64encode(v).decode() for v in stored] + [v.hex() for v in stored]

    env = {"PREFECT_API_URL": prefect_api}
    code_json, doc, err_json = cli("run", "--config", str(profile.config_path), "--json", env=env)
    assert code_json == 4  # the corrupt row keeps the run fail-closed
    assert doc["targets"]["Person"]["failed"] == 1 and doc["targets"]["Person"]["reencrypted"] == 39
    code_h, out_h, err_h = cli("run", "--config", str(profile.config_path), env=env)
    code_inv, inv, err_inv = cli("inventory", "--deep", "--config", str(profile.config_path), "--json")
    code_gate, gate, err_gate = cli("gate", "--retire", "1", "--config", str(profile.config_path), "--json")
    assert code_gate == 3 and gate["blocking"]["FAILED"] == 1
    assert code_h == 4 and code_inv == 0
    assert "MARKER" not in err_json  # cheap first check with a readable failure

    with get_client(sync_client=True) as client:
        run_filter = FlowRunFilter(id=FlowRunFilterId(any_=[doc["run_id"]]))
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[doc["run_id"]])))
        artifacts = client.read_artifacts(flow_run_filter=run_filter)
        flow_run = client.read_flow_run(doc["run_id"])
    assert flow_run.state is not None and flow_run.state.is_failed()  # fail-closed shows as Failed in the UI
    assert "Person: 1 rows left unchanged" in (flow_run.state.message or "")
    assert logs, "the run logged nothing to Prefect"
    assert any("batch_processed" in log.message for log in logs), "pinrotate's own log lines reach the run logs"
    everything = "\n".join([
        repr(doc), err_json, out_h, err_h, repr(inv), err_inv, repr(gate), err_gate,
        *(log.message for log in logs), *(repr(a.data) + repr(a.description) for a in artifacts),
        repr(flow_run.parameters), repr(flow_run.state.message if flow_run.state else ""),
    ])
    leaked = [s for s in secrets if s in everything]
    assert not leaked, f"{len(leaked)} secret strings leaked, e.g. {leaked[0][:12]}..."


def test_write_config_keeps_single_instance(tmp_path: Path) -> None:
    from pinrotate_core.config import load_settings

    cfg = write_config(tmp_path / "c.toml", "postgresql://x@127.0.0.1/db", tmp_path / "k.toml", single_instance=True)
    assert load_settings(cfg).job.single_instance is True
