"""``run`` on MariaDB goes through the Prefect flow as on PostgreSQL (issue 32): a flow run with its
task runs and one run id, Dask shards over id ranges, the throttle (``Threads_running``, the
operator's Variable), Ctrl-C between batches with exit 130, and a gate section decided by the deep
look of ``gate --retire`` (fail closed)."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pymysql
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import load_settings
from pinrotate_core.drain import STOP_THROTTLE_CRITICAL
from tests.mariadb_server import MariaDbServer
from tests.prefect_reads import recorded_task_runs

from .codecs import forge_fpc1
from .pin_data import PinInstall, install_pin
from .support import _FOREIGN_SETTINGS, REPO, connect, file_keyring, finish, rotate, write_toml

pytestmark = pytest.mark.mysql


def task_runs(run_id: str) -> dict[str, Any]:

    return {t.name: t.state for t in recorded_task_runs(run_id)}


def flow_run_state(run_id: str) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state


def shard_rows(run_id: str) -> list[dict[str, Any]]:
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    (table,) = [a for a in artifacts if a.type == "table"]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    return [r for r in rows if r["shard"] != "total"]


def assert_every_person_whole(pin: PinInstall, on: dict[int, int]) -> None:
    """Every row decrypts, under the key its key_version names, to the plaintext seeded."""
    read = pin.read("persons", pin.keys)
    assert {row_id: plain for row_id, (_, plain) in read.items()} == \
        {row_id: plain for (table, row_id), plain in pin.plain.items() if table == "persons"}
    assert pin.key_versions("persons") == on


def test_a_run_on_mariadb_is_a_flow_run_with_its_task_runs_batch_lines_and_spans_and_moves_every_row(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path, prefect_api: str) -> None:
    from tests.otlp_collector import Collector, ancestry

    pin = install_pin(mariadb, mysql_database, tmp_path, persons=40, documents=0)
    new = pin.promote_new_key()
    cfg = pin.config(tables=("persons",), batch_size=10)
    with Collector() as collector:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith((*_FOREIGN_SETTINGS, "OTEL_"))},
               "PREFECT_API_URL": prefect_api, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint}
        proc = subprocess.Popen([sys.executable, "-m", "flows.rotate", "run", "--config", str(cfg), "--json"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        code, doc, err = finish(proc)
        spans = list(collector.spans)
    assert code == 0, err
    person = doc["targets"]["Person"]
    assert (person["reencrypted"], person["failed"], person["backlog_remaining"]) == (40, 0, 0)
    assert doc["verified"]["Person"]["ok"] and doc["verified"]["Person"]["sampled"] > 0
    assert_every_person_whole(pin, {new: 40})
    # One run id everywhere: the flow run's, with the drain's task run and the flow's other steps.
    state = flow_run_state(doc["run_id"])
    assert state is not None and state.is_completed(), state
    runs = task_runs(doc["run_id"])
    steps = {name.rsplit("-", 1)[0] if not name.startswith("drain-") else name for name in runs}
    assert {"read_current_key", "plan_shards", "drain-Person-1/1", "verify", "retire_gate_report"} <= steps, runs
    assert runs["drain-Person-1/1"] is not None and runs["drain-Person-1/1"].is_completed()
    # Per-batch log lines under the run id, as on PostgreSQL.
    batches = [line for line in err.splitlines() if "batch_processed" in line and doc["run_id"] in line]
    assert len(batches) == 4, err[-4000:]
    # A pinrotate.batch span per batch transaction, beneath the flow run's span (contract §7).
    batch_spans = [s for s in spans if s.name == "pinrotate.batch"]
    assert len(batch_spans) == 4 and sum(s.attributes["pinrotate.rows"] for s in batch_spans) == 40
    assert {(s.attributes["pinrotate.run_id"], s.attributes["pinrotate.target"],
             s.attributes["pinrotate.current_key"]) for s in batch_spans} == {(doc["run_id"], "Person", str(new))}
    by_id = {s.span_id: s for s in spans if s.trace_id == batch_spans[0].trace_id}
    for b in batch_spans:
        assert list(ancestry(b, by_id))[-1].attributes.get("prefect.run.id") == doc["run_id"]

def test_two_dask_workers_drain_a_mariadb_target_in_two_id_range_shards_losing_nothing(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path, prefect_api: str) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=260, documents=0)
    new = pin.promote_new_key()
    cfg = pin.config(tables=("persons",), batch_size=5, task_runner="dask", max_degree_of_parallelism=2)
    proc = subprocess.Popen([sys.executable, "-m", "flows.rotate", "run", "--config", str(cfg), "--json"], cwd=REPO,
                            env={**{k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_SETTINGS)},
                                 "PREFECT_API_URL": prefect_api},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, doc, err = finish(proc, timeout=400)
    assert code == 0, err[-4000:]
    person = doc["targets"]["Person"]
    assert (person["reencrypted"], person["failed"], person["backlog_remaining"]) == (260, 0, 0)
    # Nothing left unrecorded on MySQL: no shard has a note to make (key checks and CONFLICTs are kept).
    assert person.get("notes", []) == [], person
    assert_every_person_whole(pin, {new: 260})
    shards = shard_rows(doc["run_id"])
    assert sorted(s["shard"] for s in shards) == ["1/2", "2/2"], shards
    assert all(s["reencrypted"] > 0 for s in shards) and sum(s["reencrypted"] for s in shards) == 260
    # In Dask worker processes, not in the CLI's.
    assert str(proc.pid) not in {s["worker"].rsplit(":", 1)[1] for s in shards}
    assert {"drain-Person-1/2", "drain-Person-2/2"} <= set(task_runs(doc["run_id"]))


def test_the_shards_of_a_mariadb_target_are_disjoint_id_ranges_covering_its_backlog(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=130, documents=0)
    pin.promote_new_key()
    ctx = rotation.open_run(load_settings(str(pin.config(tables=("persons",), batch_size=1))))
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        shards = rotation.plan_shards(ctx, "Person", 4)
        assert [s.rows for s in rotation.plan_shards(ctx, "Person", 1)] == [130]
    finally:
        ctx.close()
    assert len(shards) == 4 and sum(s.rows for s in shards) == 130 and all(s.exact for s in shards)
    assert shards[0].id_range[0] is None and shards[-1].id_range[1] is None  # open outer ends
    for a, b in itertools.pairwise(shards):
        assert a.id_range[1] == b.id_range[0]
    ids = sorted(pin.rows("persons"))
    for s in shards:
        lo, hi = s.id_range
        assert s.rows == sum(1 for i in ids if (lo is None or i > lo) and (hi is None or i <= hi))
        assert 20 <= s.rows <= 45, [x.rows for x in shards]  # about a quarter each


class _Sleeping:
    """Other sessions busy in a statement for ``seconds`` (Threads_running counts them), running
    when the constructor returns (seen in the process list, however loaded the machine); ``stop``
    ends their statements early and waits for them."""

    def __init__(self, server: MariaDbServer, seconds: float, sessions: int = 2) -> None:
        self.server, self.ids = server, [0] * sessions
        self.threads = [threading.Thread(target=self._sleep, args=(i, seconds), daemon=True) for i in range(sessions)]
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + 60
        with contextlib.closing(pymysql.connect(host=server.host, port=server.port, user="root")) as conn:
            while True:
                ids = [i for i in self.ids if i]
                if len(ids) == sessions:
                    with conn.cursor() as cur:
                        cur.execute("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID IN "
                                    f"({', '.join(['%s'] * sessions)}) AND INFO LIKE %s", (*ids, "SELECT SLEEP(%"))
                        (running,) = cur.fetchone() or (0,)
                    if running == sessions:
                        return
                assert time.monotonic() < deadline, "the sleeping sessions never started"
                time.sleep(0.05)

    def _sleep(self, i: int, seconds: float) -> None:
        conn = pymysql.connect(host=self.server.host, port=self.server.port, user="root")
        self.ids[i] = conn.thread_id()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT SLEEP(%s)", (seconds,))
        finally:
            conn.close()

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def stop(self) -> None:
        with contextlib.closing(pymysql.connect(host=self.server.host, port=self.server.port, user="root")) as conn:
            for thread_id in self.ids:
                with contextlib.suppress(pymysql.err.MySQLError), conn.cursor() as cur:
                    cur.execute("KILL QUERY %s", (thread_id,))
        self.join()


def test_the_throttle_on_mariadb_waits_on_threads_running_and_stops_past_the_critical_limit(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=20, documents=0)
    new = pin.promote_new_key()
    settings = load_settings(str(pin.config(tables=("persons",), batch_size=5, max_active_sessions=1)))
    ctx = rotation.open_run(settings)
    sleeper = _Sleeping(mariadb, 60)
    try:
        throttle = ctx.run_throttle()
        state = throttle.check()
        assert state.reason == "load" and state.sessions is not None and state.sessions >= 2, state
    finally:
        sleeper.stop()
        ctx.close()

    critical = load_settings(str(pin.config("critical.toml", tables=("persons",), batch_size=5,
                                            critical_active_sessions=1)))
    ctx = rotation.open_run(critical)
    sleeper = _Sleeping(mariadb, 60)
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        result = rotation.drain(ctx, "Person")
    finally:
        sleeper.stop()
        ctx.close()
    assert result.stopped == STOP_THROTTLE_CRITICAL and "critical_active_sessions" in (result.error or "")
    assert result.reencrypted == 0 and pin.key_versions("persons") == {pin.old: 20}

    # Past the plain limit a drain waits while they run, then resumes and moves every row.
    ctx = rotation.open_run(settings)
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        sleeper = _Sleeping(mariadb, 2, sessions=3)
        result = rotation.drain(ctx, "Person")
        sleeper.join()
    finally:
        ctx.close()
    assert (result.reencrypted, result.stopped, result.backlog_remaining) == (20, None, 0)
    assert ctx.throttle is not None and ctx.throttle.waited["load"] > 0
    assert_every_person_whole(pin, {new: 20})


def test_a_prefect_variable_set_to_paused_stops_a_mariadb_drain_and_clearing_it_resumes(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path, prefect_api: str) -> None:
    from prefect.variables import Variable

    from flows.throttle import VariableThrottleControl

    pin = install_pin(mariadb, mysql_database, tmp_path, persons=30, documents=0)
    new = pin.promote_new_key()
    name = f"pinrotate-test-{secrets.token_hex(4)}"
    settings = load_settings(str(pin.config(tables=("persons",), batch_size=5, inter_batch_delay=0.1)))
    ctx = rotation.open_run(settings)
    ctx.throttle_control = VariableThrottleControl(name, ttl=0.2)
    results: list[Any] = []
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        Variable.set(name, {"paused": True}, overwrite=True)
        ctx.throttle_control.refresh()  # as the drain task does before its first batch
        drain = threading.Thread(target=lambda: results.append(rotation.drain(ctx, "Person")))
        drain.start()
        time.sleep(2)
        assert pin.key_versions("persons") == {pin.old: 30}  # paused before its first batch: nothing written
        assert ctx.throttle is not None and ctx.throttle.state()["status"] == "paused"
        Variable.set(name, {}, overwrite=True)
        drain.join(timeout=120)
        assert not drain.is_alive()
    finally:
        ctx.stop.set()
        Variable.unset(name)
        ctx.close()
    (result,) = results
    assert (result.reencrypted, result.stopped, result.backlog_remaining) == (30, None, 0)
    assert ctx.throttle.waited["paused"] > 0
    assert_every_person_whole(pin, {new: 30})


def test_ctrl_c_stops_a_mariadb_run_between_batches_with_exit_130_losing_nothing_committed(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path, prefect_api: str) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=60, documents=0)
    new = pin.promote_new_key()
    cfg = pin.config(tables=("persons",), batch_size=5, inter_batch_delay=0.3)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_SETTINGS)},
           "PREFECT_API_URL": prefect_api}
    proc = subprocess.Popen([sys.executable, "-m", "flows.rotate", "run", "--config", str(cfg), "--json"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while pin.key_versions("persons").get(new, 0) == 0:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no batch was committed in time"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # the whole foreground group, as the terminal does
    code, doc, err = finish(proc, timeout=120)
    assert code == 130 and doc["exit_code"] == 130 and doc["stopped"] == "cancelled", err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    moved = doc["targets"]["Person"]["reencrypted"]
    assert 0 < moved < 60
    assert_every_person_whole(pin, {new: moved, pin.old: 60 - moved})
    state = flow_run_state(doc["run_id"])
    assert state is not None and state.is_cancelled(), state
    drains = {n: s for n, s in task_runs(doc["run_id"]).items() if n.startswith("drain-")}
    assert drains and all(s is not None and s.is_cancelled() for s in drains.values()), drains


def _secrets_db(server: MariaDbServer, database: str, tmp_path: Path) -> tuple[Path, str, list[str], dict[str, bytes]]:
    """One fpc1 target: two values on the oldest key, one on the previous, two on the active one."""
    active, previous, old = f"act{secrets.token_hex(5)}", f"prv{secrets.token_hex(5)}", f"old{secrets.token_hex(5)}"
    keys = {active: secrets.token_bytes(16), previous: secrets.token_bytes(16), old: secrets.token_bytes(16)}
    keys_file = file_keyring(tmp_path / "keys" / "keys.toml", active, keys)
    under = {1: old, 2: old, 3: previous, 4: active, 5: active}
    with connect(server, database) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE api_secrets (id bigint PRIMARY KEY, secret_cipher varchar(500) NULL)"
                    " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4")
        for i, key in under.items():
            cur.execute("INSERT INTO api_secrets VALUES (%s, %s)", (i, forge_fpc1("SM4", key, keys[key], f"s-{i}")))
    cfg = write_toml(tmp_path / "pinrotate.toml", {
        "database": {"url": server.url(database)},
        "keys": {"provider": "file", "file": str(keys_file), "write_versioned": True},
        "job": {"batch_size": 2, "inter_batch_delay": 0},
        "targets": [{"name": "ApiSecret", "table": "api_secrets", "id": "id", "columns": ["secret_cipher"],
                     "format": "fpc1"}],
    })
    return cfg, active, [old, previous], keys

@pytest.mark.server_wide  # the run's gate sweeps every database of the server (tests/conftest.py, Parallel runs)
def test_the_run_report_gate_on_mariadb_opens_only_when_the_deep_look_finds_nothing_under_the_key(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path, prefect_api: str) -> None:
    cfg, active, (old, previous), keys = _secrets_db(mariadb, mysql_database, tmp_path)
    code, doc, err = rotate("run", "--expected-key-version", active, "--config", str(cfg), "--json",
                            prefect_api=prefect_api)
    assert code == 0, err
    assert doc["targets"]["ApiSecret"]["reencrypted"] == 3
    # Both older keys decided by one look: nothing is left under either.
    assert (doc["gate"][old]["open"], doc["gate"][previous]["open"]) == (True, True), doc["gate"]
    assert "not decided" not in str(doc["gate"])

    with mariadb.fresh_database() as other:
        with connect(mariadb, other) as conn, conn.cursor() as cur:
            # A copy someone made in another database of the same server, under the oldest key.
            cur.execute("CREATE TABLE stash (id int PRIMARY KEY, note text NULL) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4")
            cur.execute("INSERT INTO stash VALUES (1, %s)", (forge_fpc1("SM4", old, keys[old], "copied secret"),))
        code, doc, err = rotate("run", "--expected-key-version", active, "--config", str(cfg), "--json",
                                prefect_api=prefect_api)
    assert code == 0, err
    assert doc["targets"]["ApiSecret"]["reencrypted"] == 0
    assert doc["gate"][old]["open"] is False
    assert {k: n for k, n in doc["gate"][old]["blocking"].items() if n} == {"OUTSIDE_TARGETS": 1}
    assert doc["gate"][previous]["open"] is True  # the find is under the oldest key only
    assert "copied secret" not in str(doc)
