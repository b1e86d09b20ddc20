"""The Prefect flow: a run end to end, its artifacts, cancellation through the API, and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from tests.pinprofile import REPO, PinProfile, cli, seed_profile, write_config
from tests.prefect_reads import recorded_task_runs

CONTRACT_TARGET_KEYS = {"reencrypted", "failed", "conflicts", "backlog_remaining", "batches", "duration_ms"}


def rows_consistent(profile: PinProfile) -> dict[int, int]:
    """Every person row reads whole under its own key version (no half-moved row); counts per key."""
    ciphers = AesGcmCipherSet(profile.provider().load_keyring())
    per_key: dict[int, int] = {}
    with psycopg.connect(profile.url) as conn:
        cur = conn.cursor(binary=True)
        for kv, *values in cur.execute("SELECT key_version, first_name_cipher, last_name_cipher, "
                                       "middle_name_cipher, birth_date_cipher FROM profile.persons"):
            for v in values:
                if v is not None:
                    ciphers.decrypt(str(kv), v)
            per_key[kv] = per_key.get(kv, 0) + 1
    return per_key


def run_artifacts(run_id: Any) -> dict[str, list[Any]]:
    """The flow run's artifacts from the Prefect API, by type (progress, table, markdown)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    by_type: dict[str, list[Any]] = {}
    for a in artifacts:
        by_type.setdefault(a.type or "", []).append(a)
    return by_type


def report_table(by_type: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The rows of the run's report table artifact (per shard, then each target's total)."""
    table = by_type["table"][0].data
    return json.loads(table) if isinstance(table, str) else table  # type: ignore[no-any-return]


def test_flow_run_drains_every_target_and_publishes_artifacts(prefect_api: str, primary_database_url: str,
                                                             tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    from flows.rotate import pinrotate_rotate

    profile = seed_profile(primary_database_url, tmp_path, rows=300, batch_size=50, inter_batch_delay=0)
    report = pinrotate_rotate(config_path=str(profile.config_path))
    assert report["exit_code"] == 0
    assert set(report["targets"]) == {"Person", "PersonDocument", "RequisiteTemplate", "VerificationRequest"}
    for t in report["targets"].values():
        assert CONTRACT_TARGET_KEYS <= set(t) and t["backlog_remaining"] == 0
    assert report["targets"]["Person"]["reencrypted"] == 300
    assert report["gate"]["1"]["open"] is True
    assert all(v["ok"] for v in report["verified"].values())
    assert rows_consistent(profile) == {2: 300}

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(report["run_id"])
        assert run.state is not None and run.state.is_completed()
        # Parameters name things only: no key, no value, no secret.
        assert run.parameters == {"config_path": str(profile.config_path), "dry_run": False, "targets": None,
                                  "tenant": None, "expected_key_version": None}
    by_type = run_artifacts(run.id)
    assert {"table", "markdown", "progress"} <= set(by_type)
    assert by_type["progress"][0].data == 100.0
    # A key, so that `prefect artifact ls` lists it (it lists keyed artifacts only).
    assert by_type["progress"][0].key == "pinrotate-progress"
    rows = report_table(by_type)
    assert {r["target"]: r["reencrypted"] for r in rows}["Person"] == 300  # a target's last row is its total
    shards = [r for r in rows if r["target"] == "Person" and r["shard"] != "total"]
    assert shards and sum(r["reencrypted"] for r in shards) == 300
    assert "OPEN" in by_type["markdown"][0].data


def test_shards_start_largest_backlog_first_whatever_order_the_targets_are_configured_in(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:

    from flows.rotate import pinrotate_rotate

    # One worker: the shards run one after another, in the order they were submitted.
    profile = seed_profile(primary_database_url, tmp_path, rows=400, batch_size=50, inter_batch_delay=0,
                           max_degree_of_parallelism=1)
    head, *blocks = profile.config_path.read_text(encoding="utf-8").split("\n[[targets]]")
    profile.config_path.write_text("\n[[targets]]".join([head, *reversed(blocks)]), encoding="utf-8")
    report = pinrotate_rotate(config_path=str(profile.config_path))
    assert report["exit_code"] == 0
    assert list(report["targets"]) == ["VerificationRequest", "RequisiteTemplate", "PersonDocument", "Person"]
    backlog = {name: t["reencrypted"] + t["failed"] + t["backlog_remaining"]
               for name, t in report["targets"].items()}
    runs = recorded_task_runs(report["run_id"])
    drains = sorted((r for r in runs if r.name.startswith("drain-")),
                    key=lambda r: r.start_time or r.expected_start_time)
    started = [r.name.split("-")[1] for r in drains]
    assert sorted(started) == sorted(backlog)  # one shard each: 8 batches or fewer per target
    assert [backlog[name] for name in started] == sorted(backlog.values(), reverse=True), started
    assert started[0] == "Person" and backlog["Person"] == 400


def test_a_big_tables_shards_planned_from_a_page_sample_count_their_own_backlog_and_progress_ends_at_100(
        prefect_api: str, primary_database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pinrotate_core.drain.shards as drain_module
    from flows.rotate import pinrotate_rotate
    from pinrotate_core.samples import pin_profile as presets

    # "Big" scaled down: over 2 x SAMPLE_ROWS rows the plan samples pages and estimates each shard's
    # backlog instead of counting it (no counting scan of a huge table while every worker waits).
    monkeypatch.setattr(drain_module, "SAMPLE_ROWS", 400)
    monkeypatch.setattr(drain_module, "MIN_SAMPLE_PER_RANGE", 1)
    monkeypatch.setattr(drain_module, "MIN_BATCHES_PER_SHARD", 1)
    estimates: dict[str, int | None] = {}  # what each target's plan estimated (None: counted exactly)
    sampled_bounds = drain_module.ShardPlanner._sampled_bounds

    def recording(self: Any, conn: Any, ranges: int, backlog: int) -> tuple[list[Any], int | None]:
        bounds, estimate = sampled_bounds(self, conn, ranges, backlog)
        estimates[self.target.name] = estimate
        return bounds, estimate

    monkeypatch.setattr(drain_module.ShardPlanner, "_sampled_bounds", recording)
    profile = seed_profile(primary_database_url, tmp_path, rows=1600, batch_size=50, inter_batch_delay=0,
                           max_degree_of_parallelism=2)
    # A quarter of the persons already on key 2: the sample's stale share is an estimate, not 1.
    with psycopg.connect(profile.url, autocommit=True) as conn:
        presets.seed_pin_profile(conn, profile.provider().load_keyring(), rows=530, key_id="2", first_row=1600, seed=3)
        conn.execute("ANALYZE profile.persons")
    report = pinrotate_rotate(config_path=str(profile.config_path))
    assert report["exit_code"] == 0
    assert estimates["Person"] is not None  # the page-sample plan was taken
    person = report["targets"]["Person"]
    assert person["reencrypted"] == 1600 and person["backlog_remaining"] == 0
    assert rows_consistent(profile) == {2: 2130}
    by_type = run_artifacts(report["run_id"])
    assert [a.data for a in by_type["progress"]] == [100.0]  # the total follows what the shards held
    shards = [r for r in report_table(by_type) if r["target"] == "Person" and r["shard"] != "total"]
    assert len(shards) > 1 and sum(r["reencrypted"] for r in shards) == 1600


def test_cli_run_prints_one_json_report_and_a_second_run_moves_nothing(prefect_api: str, primary_database_url: str,
                                                                      tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=120, batch_size=40, inter_batch_delay=0)
    env = {"PREFECT_API_URL": prefect_api}
    code, doc, err = cli("run", "--config", str(profile.config_path), "--json", env=env)
    assert code == 0, err
    assert set(doc) >= {"run_id", "current_key", "dry_run", "targets", "verified", "gate"}
    assert doc["current_key"] == "2" and doc["dry_run"] is False
    assert doc["targets"]["Person"]["reencrypted"] == 120
    code, again, err = cli("run", "--config", str(profile.config_path), "--json", env=env)
    assert code == 0, err
    assert sum(t["reencrypted"] for t in again["targets"].values()) == 0


def test_dry_run_through_the_cli_counts_and_writes_nothing(prefect_api: str, primary_database_url: str,
                                                           tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=100, batch_size=30, inter_batch_delay=0)
    with psycopg.connect(primary_database_url) as conn:
        before = conn.execute("SELECT id, xmin::text FROM profile.persons ORDER BY id").fetchall()
    code, doc, err = cli("run", "--dry-run", "--config", str(profile.config_path), "--json",
                         env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    assert doc["dry_run"] is True and doc["targets"]["Person"]["reencrypted"] == 100
    with psycopg.connect(primary_database_url) as conn:
        assert conn.execute("SELECT id, xmin::text FROM profile.persons ORDER BY id").fetchall() == before


def _start_run(profile: PinProfile, prefect_api: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    return subprocess.Popen([sys.executable, "-m", "flows.rotate", "run", "--config", str(profile.config_path),
                             "--json"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_progress(profile: PinProfile, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until at least one batch of persons is committed on key 2 (polled; not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if profile.key_versions("persons").get(2, 0) > 0:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before the first batch: {proc.communicate()}")
        time.sleep(0.1)
    raise AssertionError("no batch was committed in time")


def _finish(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any], str]:
    out, err = proc.communicate(timeout=180)
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, (out, err)
    return proc.returncode, json.loads(lines[0]), err


SLOW_JOB = {"batch_size": 10, "inter_batch_delay": 0.3}


def _interrupt_a_run(profile: PinProfile, prefect_api: str, interrupt: Any) -> tuple[int, dict[str, Any], str, int]:
    """Start a slow run, ``interrupt(proc)`` once a batch is committed; (exit code, report, stderr, rows moved).

    Whatever stops it, the contract is the same: exit 143, every row whole on one key, and what was
    committed stays.
    """
    proc = _start_run(profile, prefect_api)
    try:
        _wait_for_progress(profile, proc)
        interrupt(proc)
        code, doc, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 143, err
    assert doc["stopped"] == "cancelled"
    moved = doc["targets"]["Person"]["reencrypted"]
    assert 0 < moved < 200
    assert rows_consistent(profile) == {2: moved, 1: 200 - moved}
    return code, doc, err, moved


def test_cancelling_the_flow_run_through_the_api_stops_between_batches(prefect_api: str, primary_database_url: str,
                                                                       tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    def cancel_in_the_api(proc: subprocess.Popen[str]) -> None:
        with get_client(sync_client=True) as client:
            running = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))))
            # This run's, by its configuration (the worker's Prefect server is shared by its tests: a
            # run another test left stopped mid-flight may still say Running there).
            running = [r for r in running if str(tmp_path) in str(r.parameters.get("config_path"))]
            assert len(running) == 1
            client.set_flow_run_state(running[0].id, Cancelling(), force=True)

    profile = seed_profile(primary_database_url, tmp_path, rows=200, **SLOW_JOB)
    _, doc, _, moved = _interrupt_a_run(profile, prefect_api, cancel_in_the_api)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(doc["run_id"]).state
        assert state is not None and state.is_cancelled()
    # The next run resumes where the data says. Only the interrupted run had to be slow: this one
    # runs without the pause between batches (the same database, keys and targets).
    rerun = write_config(tmp_path / "rerun.toml", profile.url, profile.keys_file, batch_size=50, inter_batch_delay=0)
    code, again, err = cli("run", "--config", str(rerun), "--json", env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    assert again["targets"]["Person"]["reencrypted"] == 200 - moved


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_stops_every_drain_between_batches_with_exit_143(prefect_api: str, primary_database_url: str,
                                                                 tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=200, **SLOW_JOB)
    _interrupt_a_run(profile, prefect_api, lambda proc: proc.send_signal(signal.SIGTERM))


def test_a_fail_closed_run_under_the_engine_ends_failed_with_counts_and_no_traceback_or_row_id(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    """The worker's code path (``python -m prefect.engine FLOW_RUN_ID``), as a deployment run takes it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from flows.rotate import pinrotate_rotate

    profile = seed_profile(primary_database_url, tmp_path, rows=30, batch_size=10, inter_batch_delay=0)
    with psycopg.connect(primary_database_url, autocommit=True) as conn:
        (bad_id,) = conn.execute("SELECT id FROM profile.persons ORDER BY id LIMIT 1 OFFSET 7").fetchone()
        conn.execute("UPDATE profile.persons SET first_name_cipher = set_byte(first_name_cipher, 20, "
                     "get_byte(first_name_cipher, 20) # 1) WHERE id = %s", (bad_id,))
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(pinrotate_rotate, parameters={"config_path": str(profile.config_path)})
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT__FLOW_ENTRYPOINT": "flows/rotate.py:pinrotate_rotate"}
    proc = subprocess.run([sys.executable, "-m", "prefect.engine", str(run.id)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    assert state is not None and state.is_failed(), output[-4000:]
    assert "Person: 1 rows left unchanged" in (state.message or "")
    everything = output + "\n".join(log.message for log in logs) + (state.message or "")
    assert "Traceback" not in everything and "Unexpected result" not in everything
    assert str(bad_id) not in (state.message or "") and str(bad_id) not in "\n".join(
        log.message for log in logs if "stopped fail-closed" in log.message)
    assert profile.key_versions("persons") == {2: 29, 1: 1}
    # Every row was handled (29 moved, 1 FAILED): the progress ends at 100, the failed row counted once.
    assert [a.data for a in run_artifacts(run.id)["progress"]] == [100.0]


def test_an_operator_pause_through_the_variable_shows_in_the_progress_artifact_and_clearing_it_finishes(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    """Issue 12: pause a running deployment from the Prefect UI (a Variable), see it in the run's
    progress artifact, clear it, and the run finishes with every row moved."""
    import threading
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.variables import Variable

    from flows.rotate import pinrotate_rotate

    variable = f"pinrotate_throttle_{uuid.uuid4().hex[:8]}"
    profile = seed_profile(primary_database_url, tmp_path, rows=200, batch_size=20, inter_batch_delay=0,
                           throttle_variable=variable)
    Variable.set(variable, {"paused": True}, overwrite=True)
    reports: list[dict[str, Any]] = []
    runner = threading.Thread(target=lambda: reports.append(pinrotate_rotate(config_path=str(profile.config_path))))
    try:
        runner.start()

        def paused_shown() -> bool:
            with get_client(sync_client=True) as client:
                found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["pinrotate-progress"])))
            return any(variable in (a.description or "") and "paused" in (a.description or "") for a in found)

        deadline = time.monotonic() + 120
        while not paused_shown():
            assert time.monotonic() < deadline, "the progress artifact never said the run was paused"
            time.sleep(0.5)
        assert runner.is_alive()
        with psycopg.connect(profile.url) as conn:
            row = conn.execute("SELECT count(*) FROM profile.persons WHERE key_version = 2").fetchone()
        assert row == (0,)  # paused before the first batch: nothing moved
        Variable.set(variable, {}, overwrite=True)
        runner.join(timeout=180)
    finally:
        Variable.unset(variable)
    assert not runner.is_alive() and reports and reports[0]["exit_code"] == 0
    assert rows_consistent(profile) == {2: 200}
