"""The Prefect deployment of ``prefect.yaml`` end to end: server, CLI, worker, API and UI.

Starts its own ``prefect server`` (SQLite under a temporary PREFECT_HOME, a free loopback port),
applies ``prefect.yaml`` with the real CLI, starts a run as the UI's Quick run does, lets a real
process worker execute it, reads history and artifacts back through the API, and renders the run
page in headless Chromium. Never uses ~/.prefect, never reaches beyond loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
from psycopg import sql

from tests.conftest import PG_SERVER_IDS
from tests.helpers import secret_forms
from tests.pinprofile import REPO, PinProfile, seed_profile
from tests.prefect_home import migrated_prefect_home

# xdist: every test of this module on one worker (one prefect server, seeded database and deployment for the module).
pytestmark = [pytest.mark.deployment, pytest.mark.xdist_group("test_deployment")]

DEPLOYMENT = "pinrotate-rotate/profile-reencrypt"
WORK_POOL = "pinrotate-process"
ROWS = 300
# Bounds on waiting for things that should happen in seconds; reaching one means a broken setup,
# never a slow-but-passing test.
STARTUP_BOUND_S = 180.0
RUN_BOUND_S = 180.0
CLI_BOUND_S = 180.0
LOOPBACK = "127.0.0.1,localhost"


# ---------------------------------------------------------------------------------------------
# Processes: each in its own session, so that stopping one also stops what it spawned
# (uvicorn under `prefect server start`, the flow-run process under the worker, Chromium's helpers).
# ---------------------------------------------------------------------------------------------


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 6000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        # The leader is gone; anything it left in its session goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_service(name: str, args: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> Service:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Service(name, proc, log_path)


def prefect_bin() -> str:
    return str(Path(sys.executable).parent / "prefect")


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refusing_proxy() -> str:
    """A proxy address on loopback where nothing listens: every non-loopback request fails at once."""
    return f"http://127.0.0.1:{free_loopback_port()}"


def loopback_only(env: dict[str, str]) -> dict[str, str]:
    # Loopback goes direct (NO_PROXY); anything else, e.g. the server's fetch of Prefect's collection
    # registry from GitHub (it falls back to its bundled copy), meets the refusing proxy.
    proxy = refusing_proxy()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = proxy
    env["NO_PROXY"] = env["no_proxy"] = LOOPBACK
    return env


def prefect_env(home: Path, api_url: str | None, **extra: str) -> dict[str, str]:
    """The shell's environment without its Prefect settings: only this test's home and API count."""
    env = loopback_only({k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")})
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    if api_url is not None:
        env["PREFECT_API_URL"] = api_url
    env.update(extra)
    return env


def run_cli(args: list[str], env: dict[str, str], log_dir: Path, name: str) -> str:
    proc = subprocess.run([prefect_bin(), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=CLI_BOUND_S, check=False)
    output = proc.stdout + proc.stderr
    (log_dir / f"{name}.log").write_text(output, encoding="utf-8")
    assert proc.returncode == 0, f"prefect {' '.join(args)} exited {proc.returncode}:\n{output[-6000:]}"
    return output


# ---------------------------------------------------------------------------------------------
# The Prefect server
# ---------------------------------------------------------------------------------------------


@dataclass
class PrefectServer:
    home: Path
    port: int
    service: Service

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/api"

    def env(self, **extra: str) -> dict[str, str]:
        return prefect_env(self.home, self.api_url, **extra)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_BOUND_S
        while time.monotonic() < deadline:
            if self.service.proc.poll() is not None:
                raise AssertionError(f"prefect server exited {self.service.proc.returncode}:\n"
                                     f"{self.service.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError), \
                    urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"prefect server not healthy within {STARTUP_BOUND_S:.0f} s:\n"
                             f"{self.service.log_tail()}")

    def ui_settings(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.base_url}/ui-settings", timeout=10) as resp:
            return dict(json.load(resp))


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """`prefect server start` on a free loopback port; returns at once (the caller waits for it).

    Booting takes seconds on a busy machine (its SQLite database comes migrated: tests/prefect_home.py):
    the database is seeded meanwhile. The scheduler service is off, so the deployment's interval schedule creates no
    run of its own: the Quick run is the only run, and the counts are exact.
    """
    work = tmp_path_factory.mktemp("prefect")
    home = Path(migrated_prefect_home(work / "home"))  # its SQLite database migrated already
    port = free_loopback_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = prefect_env(
        home, None,
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        PREFECT_SERVER_API_HOST="127.0.0.1",
        PREFECT_SERVER_API_PORT=str(port),
        # The UI asks /ui-settings where the API is; its default is port 4200, not --port.
        PREFECT_UI_API_URL=api_url,
        PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
    )
    service = start_service("prefect-server",
                            [prefect_bin(), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env, work, work / "server.log")
    try:
        yield PrefectServer(home, port, service)
    finally:
        service.stop()


# ---------------------------------------------------------------------------------------------
# The Pin profile database and what must never leak from it
# ---------------------------------------------------------------------------------------------


@dataclass
class SeededProfile:
    profile: PinProfile
    # target name -> (qualified table, key-version column)
    targets: dict[str, tuple[str, str]]
    backlog: dict[str, int]
    secrets: list[str] = field(repr=False)

    def rows_on_key(self, key_version: int) -> dict[str, int]:
        counts: dict[str, int] = {}
        with psycopg.connect(self.profile.url) as conn:
            for name, (table, column) in self.targets.items():
                schema, _, rel = table.partition(".")
                query = sql.SQL("SELECT count(*) FROM {} WHERE {} = %s").format(
                    sql.Identifier(schema, rel), sql.Identifier(column))
                row = conn.execute(query, (key_version,)).fetchone()
                counts[name] = int(row[0]) if row else 0
        return counts


def _leak_markers(profile: PinProfile) -> list[str]:
    """Every plaintext of the seed, every form of every key, and a sample of ciphertexts."""
    markers: set[str] = set()
    for rows in profile.summary.expected_plaintexts().values():
        for plaintexts in rows.values():
            markers.update(p.decode() for p in plaintexts.values() if p is not None)
    for key in profile.provider().load_keyring().keys.values():
        markers.update(secret_forms(key.material))
    with psycopg.connect(profile.url) as conn:
        cur = conn.cursor(binary=True)
        for (cipher,) in cur.execute("SELECT first_name_cipher FROM profile.persons ORDER BY id LIMIT 20"):
            markers.update(secret_forms(bytes(cipher)))
    return sorted(m for m in markers if len(m) >= 6)


@pytest.fixture(scope="module")
def seeded(_pg_registry: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeededProfile]:
    """The Pin profile preset, ROWS persons on key 1, key 2 promoted, on the first server only.

    One server is enough: this module proves the deployment, not the drain (tested on every
    server elsewhere), and a second pass would double its longest test.
    """
    with _pg_registry.get(PG_SERVER_IDS[0]).fresh_database() as url:
        profile = seed_profile(url, tmp_path_factory.mktemp("pin"), rows=ROWS, batch_size=50,
                               inter_batch_delay=0)
        raw = tomllib.loads(profile.config_path.read_text(encoding="utf-8"))
        targets = {t["name"]: (t["table"], t["key_version"]) for t in raw["targets"]}
        s = SeededProfile(profile, targets, {}, _leak_markers(profile))
        s.backlog = s.rows_on_key(1)
        yield s


# ---------------------------------------------------------------------------------------------
# The deployment, the Quick run and the worker
# ---------------------------------------------------------------------------------------------


@dataclass
class QuickRun:
    server: PrefectServer
    seeded: SeededProfile
    deployment_id: UUID
    flow_run_id: UUID
    deploy_output: str
    worker_output: str
    worker_exit: int | None
    work: Path


def client(server: PrefectServer) -> Any:
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(server.api_url)


@pytest.fixture(scope="module")
def quick_run(prefect_server: PrefectServer, seeded: SeededProfile,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuickRun]:
    """README's "Run it on a schedule", then Quick run: create_flow_run_from_deployment, one worker."""
    work = tmp_path_factory.mktemp("deploy")
    prefect_server.wait_ready()
    env = prefect_server.env()
    run_cli(["work-pool", "create", WORK_POOL, "--type", "process"], env, work, "work-pool-create")
    yaml_before = (REPO / "prefect.yaml").read_bytes()
    deploy_output = run_cli(["--no-prompt", "deploy", "--all"],
                            prefect_server.env(PINROTATE_REPO=str(REPO),
                                               PINROTATE_CONFIG=str(seeded.profile.config_path)),
                            work, "deploy")
    # `prefect deploy` may offer to save what it resolved; the checked-in file must stay as it is.
    assert (REPO / "prefect.yaml").read_bytes() == yaml_before

    with client(prefect_server) as c:
        deployment = c.read_deployment_by_name(DEPLOYMENT)
        # What the UI's Quick run does: POST /deployments/{id}/create_flow_run with no overrides.
        flow_run = c.create_flow_run_from_deployment(deployment.id)

    # --run-once: one poll picks the run up; --limit makes the worker wait for it before exiting.
    worker = start_service("prefect-worker",
                           [prefect_bin(), "worker", "start", "--pool", WORK_POOL, "--run-once", "--limit", "1",
                            "--name", "pinrotate-test-worker"],
                           env, work, work / "worker.log")
    try:
        deadline = time.monotonic() + RUN_BOUND_S
        state = None
        with client(prefect_server) as c:
            while time.monotonic() < deadline:
                # Whether the worker was gone *before* this read: if so, an unfinished run stays so.
                worker_gone = worker.proc.poll() is not None
                state = c.read_flow_run(flow_run.id).state
                if state is not None and state.is_final():
                    break
                if worker_gone:
                    raise AssertionError(f"the worker exited {worker.proc.returncode} with the run {state}:\n"
                                         f"{worker.log_tail()}")
                time.sleep(0.5)
        assert state is not None and state.is_final(), \
            f"flow run not finished within {RUN_BOUND_S:.0f} s (state {state}):\n{worker.log_tail()}"
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.proc.wait(timeout=60)
        worker_exit = worker.proc.poll()
    finally:
        worker.stop()
    yield QuickRun(prefect_server, seeded, deployment.id, flow_run.id, deploy_output,
                   worker.log_tail(10**7), worker_exit, work)


# ---------------------------------------------------------------------------------------------
# Tests: the deployment as applied, the run and its history, the artifacts, no leaks, the UI
# ---------------------------------------------------------------------------------------------


def test_prefect_yaml_applies_profile_reencrypt_with_its_schedule_pool_limit_and_pull_step(
        quick_run: QuickRun) -> None:
    from prefect.client.schemas.schedules import IntervalSchedule

    with client(quick_run.server) as c:
        d = c.read_deployment(quick_run.deployment_id)
    assert d.name == "profile-reencrypt"
    assert d.entrypoint == "flows/rotate.py:pinrotate_rotate"
    assert d.work_pool_name == WORK_POOL
    assert d.parameters == {"config_path": str(quick_run.seeded.profile.config_path), "dry_run": False}
    assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    assert d.job_variables == {"env": {"PREFECT_LOGGING_EXTRA_LOGGERS": "pinrotate"}}
    assert len(d.schedules) == 1 and isinstance(d.schedules[0].schedule, IntervalSchedule)
    assert (d.schedules[0].schedule.interval.total_seconds(), d.schedules[0].active) == (300.0, True)
    assert d.global_concurrency_limit is not None and d.global_concurrency_limit.limit == 1
    assert d.concurrency_options is not None and d.concurrency_options.collision_strategy.value == "CANCEL_NEW"
    assert set(d.tags) == {"pinrotate", "pii", "key-rotation"}


def test_quick_run_is_executed_by_the_process_worker_and_moves_every_row_to_the_new_key(
        quick_run: QuickRun) -> None:
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.client.schemas.objects import StateType

    assert quick_run.worker_exit == 0, quick_run.worker_output[-6000:]
    this_run = FlowRunFilter(id=FlowRunFilterId(any_=[quick_run.flow_run_id]))
    with client(quick_run.server) as c:
        history = c.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[quick_run.deployment_id])))
        states = c.read_flow_run_states(quick_run.flow_run_id)
        task_runs = c.read_task_runs(flow_run_filter=this_run)
    assert [r.id for r in history] == [quick_run.flow_run_id], "the Quick run is the deployment's only run"
    run = history[0]
    assert run.state is not None and run.state.is_completed(), (run.state, quick_run.worker_output[-6000:])
    assert run.work_pool_name == WORK_POOL
    assert run.parameters == {"config_path": str(quick_run.seeded.profile.config_path), "dry_run": False}
    # Scheduled by the Quick run, Pending when the worker submits it, Running in its process.
    # (The worker and then the engine each propose Pending: consecutive repeats count once.)
    types = [s.type for s in sorted(states, key=lambda s: s.timestamp)]
    assert [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]] == \
        [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.COMPLETED]
    # Task run names end in a suffix: a Prefect counter, or the shard of a drain (drain-Person-3/4).
    names = {t.name.rsplit("-", 1)[0] for t in task_runs}
    assert names == {"read_current_key", "plan_shards", "verify", "retire_gate_report",
                     *(f"drain-{n}" for n in quick_run.seeded.targets)}
    assert all(t.state is not None and t.state.is_completed() for t in task_runs)
    assert "Finished in state Completed" in quick_run.worker_output
    # The data agrees with the API: nothing left on key 1, everything the backlog held on key 2.
    assert quick_run.seeded.rows_on_key(1) == {n: 0 for n in quick_run.seeded.targets}
    assert quick_run.seeded.rows_on_key(2) == quick_run.seeded.backlog
    assert quick_run.seeded.backlog["Person"] == ROWS


def _artifacts(quick_run: QuickRun) -> dict[str, Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client(quick_run.server) as c:
        found = c.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[quick_run.flow_run_id])))
    by_type: dict[str, Any] = {}
    for a in found:
        assert a.type not in by_type, f"one {a.type} artifact per run, got more"
        by_type[a.type or ""] = a
    return by_type


def test_report_artifacts_read_back_through_the_api_hold_the_counts_and_the_open_gate(
        quick_run: QuickRun) -> None:
    artifacts = _artifacts(quick_run)
    assert set(artifacts) == {"table", "markdown", "progress"}
    assert artifacts["table"].key == "pinrotate-report" and artifacts["markdown"].key == "pinrotate-gate"
    assert artifacts["progress"].data == 100.0

    table = artifacts["table"].data
    rows = json.loads(table) if isinstance(table, str) else table
    by_target = {r["target"]: r for r in rows}
    backlog = quick_run.seeded.backlog
    assert set(by_target) == set(backlog)
    for name, row in by_target.items():
        assert (row["reencrypted"], row["failed"], row["conflicts"], row["backlog_remaining"]) == \
            (backlog[name], 0, 0, 0), name

    markdown = artifacts["markdown"].data
    assert f"# pinrotate run `{quick_run.flow_run_id}`" in markdown
    assert "Current key: **2**" in markdown
    assert f"| Person | {ROWS} | 0 | 0 | 0 |" in markdown
    assert "| 1 | OPEN | nothing |" in markdown


def test_no_plaintext_key_or_ciphertext_reaches_the_run_logs_artifacts_parameters_or_worker_output(
        quick_run: QuickRun) -> None:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with client(quick_run.server) as c:
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[quick_run.flow_run_id])))
        run = c.read_flow_run(quick_run.flow_run_id)
    assert any("event=job_completed" in log.message for log in logs), "the core's log lines reach the run logs"
    texts = {
        "run logs": "\n".join(log.message for log in logs),
        "artifacts": "\n".join(f"{a.description}\n{a.data}" for a in _artifacts(quick_run).values()),
        "parameters": json.dumps(run.parameters),
        "worker output": quick_run.worker_output,
        "deploy output": quick_run.deploy_output,
    }
    markers = quick_run.seeded.secrets
    assert len(markers) > ROWS
    for where, text in texts.items():
        leaked = [m for m in markers if m in text]
        assert not leaked, f"{len(leaked)} plaintext/key/ciphertext value(s) found in the {where}"


# ---------------------------------------------------------------------------------------------
# The UI in headless Chromium
# ---------------------------------------------------------------------------------------------


def chromium_bin() -> str:
    found = shutil.which("chromium")
    assert found, "chromium is missing: run scripts/ensure-ops-tools.sh (Debian's chromium package)"
    return found


@dataclass
class Capture:
    png: Path
    dom: str


def capture_pages(urls: dict[str, str], work: Path, budget_ms: int) -> dict[str, Capture]:
    """Screenshot and rendered DOM of each page, one fresh headless Chromium per page, in parallel."""
    running: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
    try:
        for name, url in urls.items():
            profile = work / f"chromium-{name}-{budget_ms}"
            profile.mkdir()
            png, dom = work / f"{name}.png", work / f"{name}.html"
            args = [chromium_bin(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={profile}",
                    # No name resolves, and any other address meets a refusing proxy (Chromium never
                    # proxies loopback): only the server on 127.0.0.1 is reachable.
                    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
                    f"--proxy-server={refusing_proxy()}",
                    "--dump-dom", f"--screenshot={png}", "--window-size=1400,1000",
                    f"--virtual-time-budget={budget_ms}", url]
            env = {**os.environ, "XDG_CONFIG_HOME": str(profile), "XDG_CACHE_HOME": str(profile)}
            with open(dom, "wb") as out, open(work / f"{name}-{budget_ms}.log", "wb") as err:
                proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True)
            running[name] = (proc, png, dom)
        captures: dict[str, Capture] = {}
        for name, (proc, png, dom) in running.items():
            rc = proc.wait(timeout=CLI_BOUND_S)
            assert rc == 0, f"chromium exited {rc} on {urls[name]}"
            captures[name] = Capture(png, dom.read_text(encoding="utf-8", errors="replace"))
        return captures
    finally:
        for proc, _, _ in running.values():
            Service("chromium", proc, work / "unused.log").stop()


def png_distinct_colours(path: Path, *, step: int = 4) -> tuple[int, int, int]:
    """(width, height, distinct RGB colours on a grid of every ``step``-th pixel), stdlib only."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, ihdr, idat = 8, b"", bytearray()
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            ihdr = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", ihdr)
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, "expected 8-bit RGB(A), not interlaced"
    bpp = 3 if colour_type == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(bytes(idat))
    prev = bytearray(stride)
    colours: set[bytes] = set()
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        # Undo the PNG row filters (RFC 2083 §6): None, Sub, Up, Average, Paeth.
        if kind == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif kind == 2:
            line = bytearray(map(lambda v, up: (v + up) & 0xFF, line, prev))
        elif kind == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a, c = (line[i - bpp], prev[i - bpp]) if i >= bpp else (0, 0)
                b = prev[i]
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        if y % step == 0:
            colours.update(bytes(line[x:x + 3]) for x in range(0, stride, bpp * step))
        prev = line
    return width, height, len(colours)


def _artifacts_tab_rendered(dom: str) -> bool:
    return ('aria-selected="true"' in dom and "-trigger-Artifacts" in dom
            and ">pinrotate-report</h3>" in dom and ">pinrotate-gate</h3>" in dom)


def _gate_rendered(dom: str) -> bool:
    """The markdown artifact rendered as HTML: headings and table cells, not only its raw text."""
    return (re.search(r"<h2[^>]*>Retire gate</h2>", dom) is not None
            and re.search(r"<td[^>]*>OPEN</td>", dom) is not None)


def test_headless_chromium_renders_the_run_page_with_its_report_and_gate_artifacts(quick_run: QuickRun) -> None:
    server = quick_run.server
    settings = server.ui_settings()
    assert settings["api_url"] == server.api_url, "the UI would call another API than this server"
    assert "v2" in settings["available_uis"], f"this Prefect serves no v2 UI: {settings}"
    ui = server.base_url + (settings["v2_base_url"] or "/v2").rstrip("/")
    gate_id = _artifacts(quick_run)["markdown"].id
    urls = {"flow-run": f"{ui}/runs/flow-run/{quick_run.flow_run_id}?tab=Artifacts",
            "gate": f"{ui}/artifacts/artifact/{gate_id}"}
    work = quick_run.work / "ui"
    work.mkdir()

    # The SPA renders once its API calls return; a loaded machine may need more virtual time.
    captures: dict[str, Capture] = {}
    for budget_ms in (15_000, 40_000):
        for stale in work.glob("*.png"):
            stale.unlink()
        captures = capture_pages(urls, work, budget_ms)
        if _artifacts_tab_rendered(captures["flow-run"].dom) and _gate_rendered(captures["gate"].dom):
            break

    run_page, gate_page = captures["flow-run"], captures["gate"]
    assert "Can't connect to Server API" not in run_page.dom
    assert _artifacts_tab_rendered(run_page.dom), "the run page shows no artifacts tab with both artifacts"
    assert ">Completed<" in run_page.dom and ">PROGRESS<" in run_page.dom.upper()
    assert _gate_rendered(gate_page.dom), "the gate markdown did not render as tables"
    assert re.search(rf"<td[^>]*>Person</td><td[^>]*>{ROWS}</td>", gate_page.dom), "the report table lost its counts"
    for where, dom in (("run page", run_page.dom), ("gate page", gate_page.dom)):
        leaked = [m for m in quick_run.seeded.secrets if m in dom]
        assert not leaked, f"{len(leaked)} plaintext/key/ciphertext value(s) rendered on the {where}"

    width, height, colours = png_distinct_colours(run_page.png)
    assert (width, height) == (1400, 1000)
    assert colours > 32, f"the screenshot looks blank ({colours} colours)"
    assert run_page.png.stat().st_size < 300_000
    keep = os.environ.get("PINROTATE_TEST_SCREENSHOT_TO")
    if keep:
        shutil.copyfile(run_page.png, keep)
