"""Say what was decided for what (issue 33): the gate names the database (host, name, PostgreSQL
system identifier) and the keyring it decided for, in its text and its JSON; and a run carries one
run id everywhere, the flow run's: its report, its log lines, and the key checks it records. In the
Prefect UI, the run's line per batch is at DEBUG."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg

from tests.pinprofile import cli, cli_all, seed_profile


def test_a_run_has_one_run_id_and_the_gate_names_its_database_and_keyring(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    profile = seed_profile(primary_database_url, tmp_path, rows=20, batch_size=50, inter_batch_delay=0)
    code, doc, err = cli("run", "--config", str(profile.config_path), "--json", env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    run_id = doc["run_id"]
    assert set(re.findall(r"run_id=(\S+)", err)) == {run_id}, err[-4000:]
    with psycopg.connect(primary_database_url) as conn:
        recorded_by = {r[0] for r in conn.execute("SELECT recorded_by FROM pinrotate.key_checks")}
        sysid, name = conn.execute("SELECT system_identifier::text, current_database() "
                                   "FROM pg_control_system()").fetchone()  # type: ignore[misc]
    assert recorded_by and all(by.endswith(f" run {run_id}") for by in recorded_by), recorded_by
    # In the Prefect UI the line per batch is DEBUG, the milestones INFO; the terminal keeps both at INFO.
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    levels = {(log.message.split()[0], log.level) for log in logs if log.message.startswith("event=")}
    assert ("event=batch_processed", 10) in levels and ("event=target_started", 20) in levels, levels
    assert ("event=batch_processed", 20) not in levels
    assert " INFO pinrotate event=batch_processed" in err
    # A shard's lines name it (its backlog is the shard's, not the target's).
    for event in ("target_started", "batch_processed", "target_completed"):
        lines = [line for line in err.splitlines() if f"event={event} " in line]
        assert lines and all(re.search(r" shard=\S+", line) for line in lines), (event, err[-4000:])

    (json_code, gate, gate_err), (text_code, text, _) = cli_all(
        [["gate", "--retire", "1", "--config", str(profile.config_path), "--json"],
         ["gate", "--retire", "1", "--config", str(profile.config_path)]])
    assert json_code == 0 and text_code == 0, gate_err
    assert gate["database"]["database"] == name and gate["database"]["system_identifier"] == sysid
    db = gate["database"]
    assert db["host"]  # an address, or the socket folder of a local server
    where = db["host"] + (f":{db['port']}" if db["port"] else "")
    assert gate["keyring"] == {"provider": "file", "source": f"file {profile.keys_file}"}
    assert f"decided for database {name} on {where} (system identifier {sysid}), keyring file {profile.keys_file}" \
        in text, text
