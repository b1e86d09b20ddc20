"""``[job] task_runner = "dask"``: the drain tasks run in Dask worker processes (a real local cluster).

Driven as an operator would: ``python -m flows.rotate run`` in a subprocess, against the session's
Prefect server, with a local cluster of ``max_degree_of_parallelism`` worker processes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from tests.pinprofile import REPO, PinProfile, cli, seed_profile, write_config
from tests.test_ctrl_c import ctrl_c_twice
from tests.test_flow import rows_consistent

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process trees")

DASK = {"task_runner": "dask", "max_degree_of_parallelism": 2}
TABLES = ("persons", "person_documents", "requisite_templates", "verification_requests")
SLOW_JOB = {"batch_size": 10, "inter_batch_delay": 0.3}


def _start(profile: PinProfile, prefect_api: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    return subprocess.Popen([sys.executable, "-m", "flows.rotate", "run", "--config", str(profile.config_path),
                             "--json"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start_as_a_job(profile: PinProfile, prefect_api: str) -> subprocess.Popen[str]:
    """``run --json`` in a process group of its own, as a shell starts a foreground job (a Ctrl-C
    at the terminal reaches the whole group: the CLI and its local cluster's workers)."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    return subprocess.Popen([sys.executable, "-m", "flows.rotate", "run", "--config", str(profile.config_path),
                             "--json"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _ctrl_c_while_draining(profile: PinProfile, prefect_api: str, *,
                           times: int) -> tuple[int, dict[str, Any], str, list[psutil.Process]]:
    """A local-cluster run started as a job, given ``times`` Ctrl-C (to its whole process group, as
    the terminal sends it) once a batch has committed: (exit code, JSON document, stderr, the
    cluster's worker processes as they were)."""
    proc = _start_as_a_job(profile, prefect_api)
    try:
        _wait_for_progress(profile, proc)
        workers = _dask_workers(proc)
        assert workers, "no local Dask worker process under the CLI"
        if times == 2:
            out, err, seconds = ctrl_c_twice(proc, timeout=300)
            lines = [line for line in out.splitlines() if line.strip()]
            assert len(lines) == 1, (out, err[-4000:])
            code, doc = proc.returncode, json.loads(lines[0])
        else:
            os.killpg(proc.pid, signal.SIGINT)  # the whole foreground group, as the terminal does
            began = time.monotonic()
            code, doc, err = _finish(proc)
            seconds = time.monotonic() - began
        print(f"stopped {seconds:.1f} s after the last Ctrl-C")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, doc, err, workers


def _finish(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any], str]:
    out, err = proc.communicate(timeout=300)
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, (out, err[-4000:])
    return proc.returncode, json.loads(lines[0]), err


def _wait_for_progress(profile: PinProfile, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    """Until at least one batch of persons is committed on key 2 (polled; not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if profile.key_versions("persons").get(2, 0) > 0:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before the first batch: {proc.communicate()}")
        time.sleep(0.1)
    raise AssertionError("no batch was committed in time")


def _dask_workers(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """The worker processes of the CLI's local cluster: its children started by multiprocessing."""
    workers = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "multiprocessing.spawn" in " ".join(child.cmdline()) or "spawn_main" in " ".join(child.cmdline()):
                workers.append(child)
        except psutil.NoSuchProcess:
            continue
    return workers


def _draining_worker(proc: subprocess.Popen[str], timeout: float = 60) -> psutil.Process:
    """A worker process that holds database connections right now, i.e. is in the middle of a drain."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in _dask_workers(proc):
            try:
                if any(c.raddr and c.status == psutil.CONN_ESTABLISHED for c in worker.net_connections("inet")
                       if c.raddr and c.raddr.port not in _cluster_ports(proc)):
                    return worker
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.1)
    raise AssertionError("no Dask worker process was draining")


def _cluster_ports(proc: subprocess.Popen[str]) -> set[int]:
    """Ports the CLI process listens on (scheduler, nannies): a worker's connections to them are not drains."""
    try:
        return {c.laddr.port for c in psutil.Process(proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        return set()


def _shard_rows(prefect_api: str, run_id: str) -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    (table,) = [a for a in artifacts if a.type == "table"]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    return [r for r in rows if r["shard"] != "total"]


def test_a_dask_run_drains_every_pin_profile_target_in_worker_processes(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=400, batch_size=50, inter_batch_delay=0, **DASK)
    proc = _start(profile, prefect_api)
    code, doc, err = _finish(proc)
    assert code == 0, err[-4000:]
    assert set(doc["targets"]) == {"Person", "PersonDocument", "RequisiteTemplate", "VerificationRequest"}
    assert all(t["backlog_remaining"] == 0 and t["failed"] == 0 for t in doc["targets"].values())
    assert doc["targets"]["Person"]["reencrypted"] == 400
    assert all(v["ok"] and v["sampled"] > 0 for v in doc["verified"].values())
    assert doc["gate"]["1"]["open"] is True
    assert rows_consistent(profile) == {2: 400}  # every person row decrypts, whole, under key 2
    for table in ("person_documents", "requisite_templates"):
        assert set(profile.key_versions(table)) == {2}
    # The shards ran in worker processes, not in the CLI's process.
    shards = _shard_rows(prefect_api, doc["run_id"])
    workers = {row["worker"].rsplit(":", 1)[1] for row in shards}
    assert shards and str(proc.pid) not in workers
    assert sum(r["reencrypted"] for r in shards if r["target"] == "Person") == 400
    # The terminal shows every batch once (the workers leave their stderr to the flow, which logs
    # their lines), and none of Dask's own INFO lines about starting and stopping its processes.
    batch_lines = [line for line in err.splitlines() if "event=batch_processed" in line]
    assert len(batch_lines) == sum(t["batches"] for t in doc["targets"].values()), err[-4000:]
    assert len(set(batch_lines)) == len(batch_lines)
    dask_info = [line for line in err.splitlines() if re.search(r"\bdistributed\.[\w.]+ - INFO - ", line)]
    assert not dask_info, dask_info[:10]


@pytest.mark.slow
def test_a_worker_killed_mid_run_loses_nothing_and_a_rerun_completes(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=300, **SLOW_JOB, **DASK)
    proc = _start(profile, prefect_api)
    try:
        _wait_for_progress(profile, proc)
        victim = _draining_worker(proc)
        victim.send_signal(signal.SIGKILL)
        code, doc, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Either Dask ran the lost shard again on a worker (the run completes) or the run stopped
    # fail-closed (exit 4); never a half-written row, never a row lost.
    assert code in (0, 4), err[-4000:]
    per_key = rows_consistent(profile)
    assert sum(per_key.values()) == 300 and set(per_key) <= {1, 2}
    # The lost worker's counts died with it: the report and the log say so (issue 23), and the
    # backlog left is what the database holds, not a sum of stale figures.
    moved = sum(profile.key_versions(t).get(2, 0) for t in TABLES)
    reported = sum(t["reencrypted"] for t in doc["targets"].values())
    notes = [n for t in doc["targets"].values() for n in t.get("notes", [])]
    assert reported <= moved
    if reported < moved:
        assert any("not in these counts" in n for n in notes), (reported, moved, doc)
        assert "event=report_note" in err and "not in these counts" in err
    assert doc["targets"]["Person"]["backlog_remaining"] == per_key.get(1, 0)
    # The rerun on the same cluster settings, without the pause between batches that only the
    # interrupted run needed.
    rerun = write_config(tmp_path / "rerun.toml", profile.url, profile.keys_file, batch_size=50, inter_batch_delay=0,
                         **DASK)
    code, again, err = cli("run", "--config", str(rerun), "--json", env={"PREFECT_API_URL": prefect_api}, timeout=300)
    assert code == 0, err[-4000:]
    assert all(t["backlog_remaining"] == 0 for t in again["targets"].values())
    assert rows_consistent(profile) == {2: 300}


@pytest.mark.slow
def test_a_connection_killed_once_is_retried_and_the_run_ends_done_not_db_error(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=300, **SLOW_JOB, **DASK)
    proc = _start(profile, prefect_api)
    try:
        _wait_for_progress(profile, proc)
        with psycopg.connect(primary_database_url, autocommit=True) as conn:
            killed = conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                  "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                                  "AND backend_type = 'client backend'").fetchone()
        code, doc, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None and killed[0] > 0
    # Every row moved; the shard's first failure was retried and must not survive in the report.
    stops = {name: (t.get("stopped"), t.get("error"), t.get("notes"))
             for name, t in (doc or {}).get("targets", {}).items()}
    assert code == 0, f"exit {code}; targets: {stops}\n{err[-6000:]}"
    assert all("stopped" not in t and t["backlog_remaining"] == 0 for t in doc["targets"].values()), doc
    assert rows_consistent(profile) == {2: 300}
    assert doc["gate"]["1"]["open"] is True


def test_sigterm_stops_the_drains_in_worker_processes_between_batches_with_exit_143(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=200, **SLOW_JOB, **DASK)
    proc = _start(profile, prefect_api)
    try:
        _wait_for_progress(profile, proc)
        proc.send_signal(signal.SIGTERM)
        code, doc, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 143, err[-4000:]
    assert doc["stopped"] == "cancelled"
    moved = doc["targets"]["Person"]["reencrypted"]
    assert 0 < moved < 200
    # The worker's drain returned its count after a whole batch: what it reports is what committed.
    assert rows_consistent(profile) == {2: moved, 1: 200 - moved}
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(doc["run_id"]).state
    assert state is not None and state.is_cancelled()


def test_ctrl_c_to_the_process_group_of_a_run_on_a_local_cluster_stops_between_batches_with_exit_130(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    # The local cluster's worker processes are in the terminal's foreground process group too: a
    # Ctrl-C reaches each of them, not only the CLI. They must not die of it mid-batch, nor print
    # KeyboardInterrupt tracebacks; the flow's cancellation stops their drains between batches.
    profile = seed_profile(primary_database_url, tmp_path, rows=200, **SLOW_JOB, **DASK)
    code, doc, err, workers = _ctrl_c_while_draining(profile, prefect_api, times=1)
    assert code == 130, err[-4000:]
    assert doc["exit_code"] == 130 and doc["stopped"] == "cancelled", doc
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-4000:]
    moved = doc["targets"]["Person"]["reencrypted"]
    assert 0 < moved < 200
    # What the report says moved is what committed: no batch lost, none half-done.
    assert rows_consistent(profile) == {2: moved, 1: 200 - moved}
    # No worker outlives the run.
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(doc["run_id"]).state
    assert state is not None and state.is_cancelled(), state


def test_a_second_ctrl_c_on_a_local_cluster_stops_at_once_and_no_worker_writes_after_it(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    # A second Ctrl-C ends the CLI at once (os._exit): its local cluster's workers ignore SIGINT, so
    # they must not be left behind draining on their own, and nothing committed may be lost.
    profile = seed_profile(primary_database_url, tmp_path, rows=200, **SLOW_JOB, **DASK)
    code, doc, err, workers = _ctrl_c_while_draining(profile, prefect_api, times=2)
    assert code == 130, err[-4000:]
    assert doc["exit_code"] == 130 and "second Ctrl-C" in doc["error"], doc
    assert "Traceback" not in err, err[-4000:]
    # No worker outlives the command (given a few seconds to notice), and none writes after it.
    deadline = time.monotonic() + 30
    while [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, [w.cmdline() for w in workers if w.is_running()]
        time.sleep(0.2)
    after = rows_consistent(profile)  # every row whole under its own key: nothing committed lost
    assert sum(after.values()) == 200 and 0 < after.get(2, 0) < 200, after
    time.sleep(2 * SLOW_JOB["inter_batch_delay"] + 1)
    assert rows_consistent(profile) == after


def test_an_unreachable_dask_scheduler_is_exit_4_with_one_line_and_nothing_written(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    profile = seed_profile(primary_database_url, tmp_path, rows=60, batch_size=20, inter_batch_delay=0,
                           task_runner="dask", dask_address=f"tcp://127.0.0.1:{port}")
    code, out, err = cli("run", "--config", str(profile.config_path), "--json", timeout=300,
                         env={"PREFECT_API_URL": prefect_api, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"})
    assert code == 4, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("pinrotate: error: cannot connect to the Dask scheduler at"), err
    assert f"127.0.0.1:{port}" in last, err
    assert profile.key_versions("persons") == {1: 60}  # nothing was written


def _worker_settings(keys: list[str]) -> dict[str, Any]:
    import dask

    return {"MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            **{key: dask.config.get(key) for key in keys}}


def _worker_log_filters() -> tuple[bool, bool]:
    """In a worker: would its log pass (the heartbeat failure at shutdown, another error)?"""
    log = logging.getLogger("distributed.worker")

    def passes(message: str) -> bool:
        return bool(log.filter(log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), None)))

    return (passes("Failed to communicate with scheduler during heartbeat."),
            passes("Failed to communicate with scheduler during something else."))


def test_a_local_clusters_worker_processes_get_the_drain_friendly_settings() -> None:
    # The local cluster's own timers and glibc's eager trimming competed with the drain for the same
    # cores (flows/runtime.py, LOCAL_WORKER_CONFIG): they must reach the worker processes, which a
    # nanny starts with a copy of this process's Dask configuration.
    import copy

    import dask
    from distributed import Client, LocalCluster

    from flows.runtime import LOCAL_WORKER_CONFIG, task_runner
    from pinrotate_core.config import settings_from_mapping

    settings = settings_from_mapping({"database": {"url": "postgresql://unused@localhost/x"},
                                      "job": {"task_runner": "dask", "max_degree_of_parallelism": 1},
                                      "targets": [{"name": "T", "table": "t", "columns": ["c"], "key_version": "kv"}]})
    trim_key = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"  # an environment variable, not a setting
    keys = [key for key in LOCAL_WORKER_CONFIG if key != trim_key]
    saved = copy.deepcopy(dask.config.config)  # task_runner configures the whole process: undone below
    try:
        runner = task_runner(settings, None)
        with LocalCluster(**{**runner.cluster_kwargs, "n_workers": 1}) as cluster, Client(cluster) as client:
            (seen,) = client.run(_worker_settings, keys).values()
            (shutdown_heartbeat_logged, other_errors_logged) = next(iter(client.run(_worker_log_filters).values()))
            (pid,) = client.run(os.getpid).values()
    finally:
        dask.config.config.clear()
        dask.config.config.update(saved)
    assert pid != os.getpid()  # a worker process, not a thread of this one
    assert {"distributed.admin.tick.interval", "distributed.worker.memory.monitor-interval",
            "distributed.worker.profile.enabled"} <= set(keys)
    assert seen == {"MALLOC_TRIM_THRESHOLD_": str(LOCAL_WORKER_CONFIG[trim_key]),
                    **{key: LOCAL_WORKER_CONFIG[key] for key in keys}}
    assert seen["distributed.admin.tick.interval"] != dask.config.get("distributed.admin.tick.interval")  # not the default
    # The preload reached the worker process: the heartbeat that races the cluster's close leaves no
    # traceback on a CLI user's terminal; every other error of the worker is still logged.
    assert (shutdown_heartbeat_logged, other_errors_logged) == (False, True)


# -- an existing cluster: a scheduler and workers started as separate processes -------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dask(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([str(Path(sys.executable).parent / "dask"), *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _wait_for_workers(address: str, n: int, timeout: float = 180) -> None:
    from distributed import Client

    with Client(address, timeout=timeout) as client:
        client.wait_for_workers(n, timeout=timeout)


def _progress_values(run_id: str) -> list[float]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return [float(a.data) for a in found if a.type == "progress" and a.data is not None]


def _running_run_id(prefect_api: str, proc: subprocess.Popen[str], config: Path, timeout: float = 240) -> str:
    """The id of this run (by its configuration) once Prefect shows it Running. The worker's Prefect
    server is shared by its tests: a run another test ended at once (a second Ctrl-C) may still say
    Running there, and its progress is not this run's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            running = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))))
            running = [r for r in running if r.parameters.get("config_path") == str(config)]
            if running:
                return str(running[0].id)
            assert proc.poll() is None, f"the run ended before it was seen running: {proc.communicate()}"
            time.sleep(0.2)
    raise AssertionError("the run was not seen running")


@pytest.mark.slow
def test_with_an_existing_cluster_every_batch_reaches_the_cli_and_the_progress_artifact_moves_per_batch(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    """``dask scheduler`` and ``dask worker`` as an operator starts them, in processes of their own."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    scheduler = _dask(["scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"], env,
                      tmp_path / "scheduler.log")
    workers = _dask(["worker", address, "--nthreads", "1", "--nworkers", "2", "--no-dashboard"], env,
                    tmp_path / "workers.log")
    try:
        _wait_for_workers(address, 2)
        # One shard per target (each under 2 x 25 batches), a few seconds each.
        profile = seed_profile(primary_database_url, tmp_path, rows=400, batch_size=10, inter_batch_delay=0.05,
                               task_runner="dask", max_degree_of_parallelism=2, dask_address=address)
        proc = _start(profile, prefect_api)
        try:
            run_id = _running_run_id(prefect_api, proc, profile.config_path)
            seen: list[float] = []
            while proc.poll() is None:
                seen += _progress_values(run_id)
                time.sleep(0.3)
            code, doc, err = _finish(proc)
            # The last update (100 %) is written as the run ends: read once more after the exit, or a
            # loaded machine ends the command between two polls (CI: seen[-1] was 98.7).
            seen += _progress_values(run_id)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        _stop(workers)
        _stop(scheduler)
    assert code == 0, err[-4000:]
    assert doc["targets"]["Person"]["reencrypted"] == 400
    # Every batch a worker committed is a line on the CLI's terminal, though no drain ran in its process.
    shards = _shard_rows(prefect_api, doc["run_id"])
    assert shards and str(proc.pid) not in {row["worker"].rsplit(":", 1)[1] for row in shards}
    batch_lines = [line for line in err.splitlines() if "event=batch_processed" in line]
    assert len(batch_lines) == sum(t["batches"] for t in doc["targets"].values()) > 4, err[-4000:]
    assert {t for t in doc["targets"]} == {line.split("target=")[1].split()[0] for line in batch_lines}
    # The workers keep their own log of it too.
    assert "event=batch_processed" in (tmp_path / "workers.log").read_text(encoding="utf-8", errors="replace")
    # The progress artifact moved between shard ends: it showed a share that no set of finished
    # shards adds up to (each target is one shard here).
    total = sum(t["reencrypted"] for t in doc["targets"].values())
    sizes = [t["reencrypted"] for t in doc["targets"].values()]
    shard_ends = {round(100.0 * sum(s for i, s in enumerate(sizes) if mask >> i & 1) / total, 1)
                  for mask in range(1 << len(sizes))}
    assert seen and seen[-1] == 100.0
    assert set(seen) - shard_ends, f"the progress only moved when shards ended: {sorted(set(seen))}"
