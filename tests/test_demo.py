"""`python -m flows.rotate demo`: the whole rotation from nothing, as the README's first command runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.pinprofile import REPO, cli
from tests.prefect_home import migrated_prefect_home


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


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups and signals")
def test_ctrl_c_during_the_demos_flow_is_exit_130_with_one_line_and_its_sandbox_removed(tmp_path: Path) -> None:
    # No PREFECT_API_URL: the demo's temporary Prefect server, as a new user runs it. A Ctrl-C goes
    # to the whole foreground process group, as a terminal sends it, once the flow has committed a batch.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = migrated_prefect_home(tmp_path / "prefect-home")
    proc = subprocess.Popen([sys.executable, "-m", "flows.rotate", "demo", "--rows", "30000", "--json"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(iter(proc.stderr.readline, "")),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 400
        sandbox = None
        while sandbox is None:
            found = [line for line in list(err_lines) if line.startswith("demo: sandbox ")]
            if found:
                sandbox = Path(found[0].split()[2].rstrip(":"))
            assert proc.poll() is None and time.monotonic() < deadline, "".join(err_lines)[-4000:]
            time.sleep(0.1)
        while not any("running the flow" in line for line in list(err_lines)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(err_lines)[-4000:]
            time.sleep(0.1)
        url = tomllib.loads((sandbox / "pinrotate.toml").read_text())["database"]["url"]
        while True:  # a batch of the flow committed on key 2: the drains are running
            with psycopg.connect(url) as conn:
                row = conn.execute("SELECT count(*) FROM profile.persons WHERE key_version = 2").fetchone()
            if row and row[0] > 0:
                break
            assert proc.poll() is None, f"the demo ended before Ctrl-C: {''.join(err_lines)[-4000:]}"
            assert time.monotonic() < deadline, "no batch was committed in time"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.stdout.read()  # type: ignore[union-attr]
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    err = "".join(err_lines)
    assert proc.returncode == 130, err[-6000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, (out, err[-6000:])
    doc = json.loads(lines[0])
    assert set(doc) == {"error", "exit_code"} and doc["exit_code"] == 130
    assert "the demo was interrupted by Ctrl-C" in doc["error"] and "sandbox is removed" in doc["error"]
    assert [line for line in err.splitlines() if line.startswith("pinrotate: error:")] == \
        [f"pinrotate: error: {doc['error']}"], err[-6000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-6000:]
    assert not sandbox.exists()  # its PostgreSQL stopped and its folder gone
