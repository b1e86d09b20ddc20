"""Traces (contract §7): a run with the OpenTelemetry variables exports one trace, the flow run at
its root and a ``pinrotate.batch`` span per batch transaction beneath it, with no secret anywhere;
without the variables nothing is set up and nothing is exported.

The collector is real: an OTLP/HTTP endpoint in this process (tests/otlp_collector.py) decoding
what the SDK's exporter sends with ``opentelemetry-proto``. Runs are driven as an operator drives
them: ``python -m flows.rotate run --json`` in a subprocess, against the session's Prefect server.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core.samples import pin_profile as presets
from tests.otlp_collector import CollectedSpan, Collector, ancestry, tree
from tests.pinprofile import REPO, PinProfile, cli, seed_profile

ROWS = 120
JOB = {"batch_size": 10, "inter_batch_delay": 0}
DASK = {"task_runner": "dask", "max_degree_of_parallelism": 2}
BATCH_ATTRIBUTES = ("pinrotate.run_id", "pinrotate.target", "pinrotate.current_key", "pinrotate.batch_size",
                    "pinrotate.rows")
TREE_KEYS = ("pinrotate.target", "pinrotate.shard", "pinrotate.batch", "pinrotate.batch_size", "pinrotate.rows")


def _otel_env(endpoint: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **more}


def _run(profile: PinProfile, prefect_api: str, env: dict[str, str]) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run([sys.executable, "-m", "flows.rotate", "run", "--config", str(profile.config_path),
                           "--json"], cwd=REPO, env={**env, "PREFECT_API_URL": prefect_api},
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, (proc.stdout, proc.stderr[-4000:])
    return proc.returncode, json.loads(lines[0]), proc.stderr


def _secrets(profile: PinProfile) -> list[str]:
    """Everything no span may carry, as text a leak would show: the keys (base64 and hex), every
    seeded row's id and plaintext, and every ciphertext now in the tables (base64 and hex)."""
    needles: list[str] = []
    ring = profile.provider().load_keyring()
    raw = profile.keys_file.read_text(encoding="utf-8")
    for line in raw.splitlines():
        if "=" in line and line.split("=", 1)[1].strip().startswith('"'):
            value = line.split("=", 1)[1].strip().strip('"')
            if len(value) >= 16:
                needles += [value, base64.b64decode(value).hex()]
    assert len(needles) >= 4, "both keys' material must be among the needles"  # keys 1 and 2
    assert ring.current == "2"
    for table, rows in presets.expected_plaintexts(rows=ROWS, seed=7).items():
        for row_id, plaintexts in rows.items():
            needles += [str(row_id), row_id.hex]
            needles += [v.decode() for v in plaintexts.values() if v is not None]
    with psycopg.connect(profile.url) as conn:
        for table, columns in presets.CIPHER_COLUMNS.items():
            for row in conn.execute(f"SELECT {', '.join(columns)} FROM profile.{table}"):
                for v in row:
                    if v is not None:
                        needles += [base64.b64encode(bytes(v)).decode(), bytes(v).hex()]
    return needles


def _assert_no_secret(spans: list[CollectedSpan], needles: list[str]) -> None:
    text = "\n".join(f"{s.name}\n{s.raw}\n{s.resource}" for s in spans)
    leaked = [n for n in needles if n in text]
    assert not leaked, f"{len(leaked)} secrets in the spans, e.g. {leaked[:3]}"


def _the_runs_trace(collector: Collector, doc: dict[str, Any]) -> tuple[CollectedSpan, list[CollectedSpan]]:
    """The run's trace: its root (the flow run's span) and every span in it; asserts it is one trace
    holding every batch span, each hanging (transitively) from the root."""
    spans = list(collector.spans)
    batches = [s for s in spans if s.name == "pinrotate.batch"]
    assert batches, f"no pinrotate.batch span among {sorted({s.name for s in spans})}"
    assert len({s.trace_id for s in batches}) == 1, "the batches are in more than one trace"
    trace_id = batches[0].trace_id
    in_trace = [s for s in spans if s.trace_id == trace_id]
    roots = [s for s in in_trace if not s.parent_id]
    assert len(roots) == 1, [r.name for r in roots]
    root = roots[0]
    assert root.attributes.get("prefect.run.id") == doc["run_id"]
    assert root.attributes.get("prefect.run.type") == "flow"
    by_id = {s.span_id: s for s in in_trace}
    for b in batches:
        assert list(ancestry(b, by_id))[-1] is root, f"batch {b.attributes} does not hang from the flow run"
    return root, in_trace


def _assert_batches_match_report(in_trace: list[CollectedSpan], doc: dict[str, Any]) -> list[CollectedSpan]:
    batches = [s for s in in_trace if s.name == "pinrotate.batch"]
    assert len(batches) == sum(t["batches"] for t in doc["targets"].values())
    for b in batches:
        assert set(BATCH_ATTRIBUTES) <= set(b.attributes), b.attributes
        assert b.attributes["pinrotate.run_id"] == doc["run_id"]
        assert b.attributes["pinrotate.current_key"] == doc["current_key"] == "2"
        assert b.attributes["pinrotate.target"] in doc["targets"]
        assert isinstance(b.attributes["pinrotate.batch_size"], int) and b.attributes["pinrotate.batch_size"] == 10
        assert isinstance(b.attributes["pinrotate.rows"], int) and 0 < b.attributes["pinrotate.rows"] <= 10
        assert b.status[0] != 2
    for name, t in doc["targets"].items():
        mine = [b for b in batches if b.attributes["pinrotate.target"] == name]
        assert len(mine) == t["batches"], name
        assert sum(b.attributes["pinrotate.rows"] for b in mine) == t["reencrypted"], name
    return batches


def _assert_steps(root: CollectedSpan, in_trace: list[CollectedSpan], doc: dict[str, Any],
                  tasks: frozenset[str]) -> list[CollectedSpan]:
    """A span per shard drain (each the parent of its batches), per verify and per gate step; and
    Prefect's own spans of the task runs ``tasks`` in the same trace."""
    drains = [s for s in in_trace if s.name == "pinrotate.drain"]
    assert {d.attributes["pinrotate.target"] for d in drains} == set(doc["targets"])
    for name, t in doc["targets"].items():
        mine = [d for d in drains if d.attributes["pinrotate.target"] == name]
        assert sum(d.attributes["pinrotate.batches"] for d in mine) == t["batches"]
        assert sum(d.attributes["pinrotate.reencrypted"] for d in mine) == t["reencrypted"]
        assert len({d.attributes["pinrotate.shard"] for d in mine}) == len(mine)
    drain_ids = {d.span_id for d in drains}
    assert all(b.parent_id in drain_ids for b in in_trace if b.name == "pinrotate.batch")
    for step in ("pinrotate.verify", "pinrotate.gate"):
        (span,) = [s for s in in_trace if s.name == step]
        assert span.attributes["pinrotate.run_id"] == doc["run_id"]
    assert {s.name.split("-")[0] for s in in_trace if s.attributes.get("prefect.run.type") == "task"} == tasks
    return drains


FLOW_TASKS = frozenset({"read_current_key", "plan_shards", "verify", "retire_gate_report"})


@pytest.fixture
def collector() -> Any:
    with Collector() as c:
        yield c


def test_a_threads_run_exports_one_trace_with_every_batch_beneath_the_flow_run_and_no_secret(
        prefect_api: str, primary_database_url: str, tmp_path: Path, collector: Collector) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, max_degree_of_parallelism=2, **JOB)
    env = _otel_env(collector.endpoint, OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test")
    before = _secrets(profile)  # the ciphertexts under key 1
    code, doc, err = _run(profile, prefect_api, env)
    assert code == 0, err[-4000:]
    assert doc["targets"]["Person"]["reencrypted"] == ROWS
    root, in_trace = _the_runs_trace(collector, doc)
    batches = _assert_batches_match_report(in_trace, doc)
    drains = _assert_steps(root, in_trace, doc, FLOW_TASKS | {"drain"})
    by_id = {s.span_id: s for s in in_trace}
    assert all(by_id[d.parent_id].name.startswith(f"drain-{d.attributes['pinrotate.target']}-") for d in drains)
    # The standard resource variables, and the default service name.
    assert {s.resource.get("service.name") for s in in_trace} == {"pinrotate"}
    assert {s.resource.get("deployment.environment") for s in in_trace} == {"test"}
    assert {s.resource.get("process.pid") for s in batches} != {None}
    assert set(collector.requests) == {"/v1/traces"} and collector.errors == []
    assert {s.trace_id for s in collector.spans} == {root.trace_id}
    _assert_no_secret(collector.spans, before + _secrets(profile))
    # The span tree, as the runbook shows it (pytest -s prints it).
    print(tree(in_trace, TREE_KEYS))


def test_a_dask_run_exports_one_trace_with_the_batches_drained_in_worker_processes_beneath_the_flow_run(
        prefect_api: str, primary_database_url: str, tmp_path: Path, collector: Collector) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **JOB, **DASK)
    env = _otel_env(collector.endpoint, OTEL_SERVICE_NAME="pinrotate-test")
    before = _secrets(profile)  # the ciphertexts under key 1
    code, doc, err = _run(profile, prefect_api, env)
    assert code == 0, err[-4000:]
    root, in_trace = _the_runs_trace(collector, doc)
    batches = _assert_batches_match_report(in_trace, doc)
    # Prefect's spans of the drain task runs in the workers are not in the run's trace (Prefect 3
    # starts them in traces of their own): each shard's pinrotate.drain hangs from the flow run.
    drains = _assert_steps(root, in_trace, doc, FLOW_TASKS)
    assert {d.parent_id for d in drains} == {root.span_id}
    assert {s.resource.get("service.name") for s in in_trace} == {"pinrotate-test"}
    # The batches were drained (and their spans exported) by the worker processes, not the CLI's.
    flow_pid = root.resource["process.pid"]
    assert flow_pid not in {s.resource["process.pid"] for s in drains + batches}
    assert collector.errors == []
    # Nothing else was exported: no trace but the run's.
    assert {s.trace_id for s in collector.spans} == {root.trace_id}
    _assert_no_secret(collector.spans, before + _secrets(profile))


def test_a_deployment_run_records_a_row_that_does_not_decrypt_as_its_kind_with_no_row_id(
        prefect_api: str, primary_database_url: str, tmp_path: Path, collector: Collector) -> None:
    """The worker's code path (``python -m prefect.engine FLOW_RUN_ID``, as a deployment runs it): the
    SDK is set up when the flow is loaded, so the flow run is the trace's root there too. A value
    that does not decrypt is a ``decrypt_failed`` event with a count on its batch, never its row id."""
    from prefect.client.orchestration import get_client

    from flows.rotate import pinrotate_rotate

    profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, **JOB)
    with psycopg.connect(primary_database_url, autocommit=True) as conn:
        (bad_id,) = conn.execute("SELECT id FROM profile.persons ORDER BY id LIMIT 1 OFFSET 37").fetchone()
        conn.execute("UPDATE profile.persons SET first_name_cipher = set_byte(first_name_cipher, 20, "
                     "get_byte(first_name_cipher, 20) # 1) WHERE id = %s", (bad_id,))
    before = _secrets(profile)
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(pinrotate_rotate, parameters={"config_path": str(profile.config_path)})
    env = {**_otel_env(collector.endpoint), "PREFECT_API_URL": prefect_api,
           "PREFECT__FLOW_ENTRYPOINT": "flows/rotate.py:pinrotate_rotate"}
    proc = subprocess.run([sys.executable, "-m", "prefect.engine", str(run.id)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert profile.key_versions("persons") == {2: ROWS - 1, 1: 1}, proc.stderr[-4000:]
    assert collector.errors == []
    spans = list(collector.spans)
    (root,) = [s for s in spans if not s.parent_id]
    assert root.attributes["prefect.run.id"] == str(run.id)
    assert [name for name, _ in root.events][-1] == "Failed"  # Prefect's state events on the flow run's span
    assert {s.trace_id for s in spans} == {root.trace_id}
    batches = [s for s in spans if s.name == "pinrotate.batch" and s.attributes["pinrotate.target"] == "Person"]
    assert len(batches) == ROWS // 10 and all(b.attributes["pinrotate.run_id"] == str(run.id) for b in batches)
    errors = [(b.attributes["pinrotate.failed"], e) for b in batches for e in b.events]
    assert errors == [(1, ("pinrotate.error", {"error.type": "decrypt_failed", "pinrotate.count": 1}))]
    assert sum(b.attributes["pinrotate.rows"] for b in batches) == ROWS - 1
    (drain,) = [s for s in spans if s.name == "pinrotate.drain" and s.attributes["pinrotate.target"] == "Person"]
    assert drain.attributes["pinrotate.failed"] == 1 and drain.status[0] != 2  # rows left, not a stop
    _assert_no_secret(spans, before + _secrets(profile) + [str(bad_id)])


def test_the_workers_of_an_existing_dask_cluster_started_with_the_same_variables_join_the_runs_trace(
        prefect_api: str, primary_database_url: str, tmp_path: Path, collector: Collector) -> None:
    """``dask scheduler`` and ``dask worker`` as an operator starts them (no pinrotate preload): each
    worker sets up its exporter at its first drain, from its own OTEL variables, and its batches
    hang from the flow run through the RunSpec's traceparent."""
    from tests.test_flow_dask import _dask, _free_port, _stop, _wait_for_workers

    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**_otel_env(collector.endpoint), "PREFECT_API_URL": prefect_api}
    scheduler = _dask(["scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"], env,
                      tmp_path / "scheduler.log")
    workers = _dask(["worker", address, "--nthreads", "1", "--nworkers", "2", "--no-dashboard"], env,
                    tmp_path / "workers.log")
    try:
        _wait_for_workers(address, 2)
        profile = seed_profile(primary_database_url, tmp_path, rows=ROWS, task_runner="dask",
                               max_degree_of_parallelism=2, dask_address=address, **JOB)
        before = _secrets(profile)
        code, doc, err = _run(profile, prefect_api, env)
    finally:
        _stop(workers)
        _stop(scheduler)
    assert code == 0, err[-4000:]
    assert collector.errors == []
    root, in_trace = _the_runs_trace(collector, doc)
    batches = _assert_batches_match_report(in_trace, doc)
    drains = _assert_steps(root, in_trace, doc, FLOW_TASKS)
    assert {d.parent_id for d in drains} == {root.span_id}
    assert root.resource["process.pid"] not in {s.resource["process.pid"] for s in drains + batches}
    assert {s.trace_id for s in collector.spans} == {root.trace_id}
    _assert_no_secret(collector.spans, before + _secrets(profile))


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_without_the_variables_a_run_sets_up_nothing_and_exports_nothing(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES alone turn nothing on: no SDK is imported, and a
    collector on the OTLP default address (where an SDK set up with defaults would send) gets nothing."""
    if not _free(4318):
        pytest.skip("the OTLP/HTTP default port 4318 is taken on this machine")
    profile = seed_profile(primary_database_url, tmp_path, rows=40, **JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_SERVICE_NAME="pinrotate", OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test",
               PYTHONPROFILEIMPORTTIME="1")
    with Collector(port=4318) as c:
        code, doc, err = _run(profile, prefect_api, env)
    assert code == 0, err[-4000:]
    assert doc["targets"]["Person"]["reencrypted"] == 40
    assert c.requests == []
    imported = [line for line in err.splitlines() if line.startswith("import time:")]
    assert any("flows.flow" in line for line in imported), "the import profile did not reach stderr"
    assert not [line for line in imported if "opentelemetry.sdk" in line or "opentelemetry.exporter" in line]


def test_an_otlp_protocol_pinrotate_cannot_send_is_refused_with_exit_2_before_anything_is_written(
        primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=20, **JOB)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    code, out, err = cli("run", "--config", str(profile.config_path), "--json", env=env)
    assert code == 2
    assert "OTEL_EXPORTER_OTLP_PROTOCOL" in out["error"] and "http/json" in out["error"]
    assert "Traceback" not in err
    assert profile.key_versions("persons") == {1: 20}


def test_a_batch_that_fails_is_an_error_of_its_kind_without_the_exceptions_message(collector: Collector) -> None:
    """A batch whose transaction fails: status ERROR and ``error.type`` = its kind; the exception's
    message (a driver's may quote a value) and its stack trace are recorded nowhere."""
    script = textwrap.dedent("""
        from flows import traces
        from pinrotate_core import tracing
        from pinrotate_core.errors import DatabaseError, KeyUnavailable
        assert traces.setup_from_environment()
        for exc in (DatabaseError("duplicate key value (id)=(SECRET-ROW-7) 'SECRET-VALUE'"),
                    KeyUnavailable("vault said SECRET-TOKEN"), RuntimeError("SECRET-OTHER")):
            try:
                with tracing.span("pinrotate.drain", {"pinrotate.target": "Person"}):
                    with tracing.batch_span("run-1", "Person", "2", 10, batch=1):
                        raise exc
            except Exception:
                pass
        traces.flush()
    """)
    env = _otel_env(collector.endpoint)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    spans = list(collector.spans)
    assert [(s.name, s.status, s.attributes["error.type"]) for s in spans if s.name == "pinrotate.batch"] == [
        ("pinrotate.batch", (2, "db_error"), "db_error"), ("pinrotate.batch", (2, "key_unavailable"), "key_unavailable"),
        ("pinrotate.batch", (2, "RuntimeError"), "RuntimeError")]
    assert all(s.status[0] == 2 and not s.events for s in spans)  # the drain spans too; no exception event
    _assert_no_secret(spans, ["SECRET", "Traceback"])


def test_with_protocol_grpc_the_batch_spans_go_to_a_grpc_collector(tmp_path: Path) -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc: the same spans over OTLP/gRPC (a real gRPC server here)."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        script = textwrap.dedent("""
            from flows import traces
            from pinrotate_core import tracing
            assert traces.setup_from_environment()
            with tracing.batch_span("run-1", "Person", "2", 10, batch=1) as span:
                tracing.batch_written(span, 7, 0, ["decrypt_failed"])
            traces.flush()
        """)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=False,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
    finally:
        server.stop(grace=None)
    spans = [s for r in received for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    (span,) = spans
    attributes = {kv.key: kv.value for kv in span.attributes}
    assert span.name == "pinrotate.batch"
    assert attributes["pinrotate.rows"].int_value == 7 and attributes["pinrotate.batch_size"].int_value == 10
    assert [(e.name, {kv.key: kv.value.string_value or kv.value.int_value for kv in e.attributes})
            for e in span.events] == [("pinrotate.error", {"error.type": "decrypt_failed", "pinrotate.count": 1})]
