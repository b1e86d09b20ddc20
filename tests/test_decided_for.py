"""Say what was decided for what (issue 33): the gate names the database (host, name, PostgreSQL
system identifier) and the keyring it decided for, in its text and its JSON; and a run carries one
run id everywhere, the flow run's: its report, its log lines, and the key checks it records. In the
Prefect UI, the run's line per batch is at DEBUG. The assertions are one function's, which
tests/test_decided_for_mysql.py runs on MariaDB."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import psycopg

from tests.pinprofile import cli, cli_all, seed_profile


def test_a_run_has_one_run_id_and_the_gate_names_its_database_and_keyring(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=20, batch_size=50, inter_batch_delay=0)

    def recorded_by() -> set[str]:
        with psycopg.connect(primary_database_url) as conn:
            return {r[0] for r in conn.execute("SELECT recorded_by FROM pinrotate.key_checks")}

    with psycopg.connect(primary_database_url) as conn:
        sysid, name = conn.execute("SELECT system_identifier::text, current_database() "
                                   "FROM pg_control_system()").fetchone()  # type: ignore[misc]
    assert_one_run_id_and_a_gate_naming_its_database_and_keyring(
        prefect_api, profile.config_path, profile.keys_file, "1", recorded_by, (sysid, name))


def assert_one_run_id_and_a_gate_naming_its_database_and_keyring(
        prefect_api: str, config: Path, keys_file: Path, old_key: str, recorded_by: Callable[[], set[str]],
        database: tuple[str, str]) -> None:
    """A run of ``config`` (every row on ``old_key``, the keyring ``keys_file``) and, once it has
    moved them, the gate for ``old_key``; ``recorded_by``: who recorded the key checks of this
    database; ``database``: (the server's system identifier, the database's name)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    code, doc, err = cli("run", "--config", str(config), "--json", env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    run_id = doc["run_id"]
    assert set(re.findall(r"run_id=(\S+)", err)) == {run_id}, err[-4000:]
    recorded = recorded_by()
    assert recorded and all(by.endswith(f" run {run_id}") for by in recorded), recorded
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
        [["gate", "--retire", old_key, "--config", str(config), "--json"],
         ["gate", "--retire", old_key, "--config", str(config)]])
    assert json_code == 0 and text_code == 0, gate_err
    sysid, name = database
    assert gate["database"]["database"] == name and gate["database"]["system_identifier"] == sysid
    db = gate["database"]
    assert db["host"]  # an address, or the socket folder of a local server
    where = db["host"] + (f":{db['port']}" if db["port"] else "")
    assert gate["keyring"] == {"provider": "file", "source": f"file {keys_file}"}
    assert f"decided for database {name} on {where} (system identifier {sysid}), keyring file {keys_file}" \
        in text, text
