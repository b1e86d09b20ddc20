"""The command line of contract §4, driven as an operator would: a subprocess, exit codes, --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from tests.pinprofile import REPO, cli, seed_profile, write_config


def test_help_answers_without_importing_prefect() -> None:
    probe = ("import sys, flows.cli as c; rc = c.main(sys.argv[1:]); "
             "print('PREFECT_LOADED' if 'prefect' in sys.modules else 'NO_PREFECT', file=sys.stderr); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", probe, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    for command in ("run", "inventory", "gate", "demo", "keys"):
        assert command in proc.stdout
    assert "NO_PREFECT" in proc.stderr


def test_inventory_gate_and_keys_never_import_prefect(primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=40)
    probe = ("import sys, flows.cli as c; rc = c.main(sys.argv[1:]); "
             "print('PREFECT_LOADED' if 'prefect' in sys.modules else 'NO_PREFECT', file=sys.stderr); sys.exit(rc)")
    commands = (["inventory"], ["gate", "--retire", "1"], ["keys", "list"])

    def probe_run(args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", probe, *args, "--config", str(profile.config_path)],
                              cwd=REPO, capture_output=True, text=True, timeout=60)

    # Three processes at once: they only read (the gate answers closed), so none changes another's answer.
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        procs = list(pool.map(probe_run, commands))
    for args, proc in zip(commands, procs, strict=True):
        assert "NO_PREFECT" in proc.stderr, (args, proc.stderr)


def test_inventory_json_counts_rows_per_key_and_category(primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=40)
    code, doc, _ = cli("inventory", "--config", str(profile.config_path), "--json")
    assert code == 0
    assert doc["current_key"] == "2"
    person = doc["targets"]["Person"]
    assert person["total"] == 40 and person["by_key"] == {"1": 40}
    assert person["HISTORICAL"] == 40 and person["ACTIVE"] == 0
    for category in ("ACTIVE", "HISTORICAL", "NEWER", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "EXCLUDED", "FAILED",
                     "CONFLICT", "BLOCKED"):
        assert category in person
    requests = doc["targets"]["VerificationRequest"]
    assert requests["EXCLUDED"] == profile.summary.drafts > 0


def test_gate_is_closed_with_exit_3_while_rows_reference_the_key(primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=40)
    code, doc, _ = cli("gate", "--retire", "1", "--config", str(profile.config_path), "--json")
    assert code == 3
    assert doc["key"] == "1" and doc["open"] is False
    assert doc["blocking"]["HISTORICAL"] == profile.summary.total_rows - profile.summary.drafts


def test_keys_add_then_promote_then_list(primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=4, promote=False)
    cfg = str(profile.config_path)
    code, added, _ = cli("keys", "add", "--config", cfg, "--json")
    assert code == 0 and added == {"provider": f"file {profile.keys_file}", "added": "2", "current": "1"}
    code, listed, _ = cli("keys", "list", "--config", cfg, "--json")
    assert listed["current"] == "1" and listed["keys"] == ["1", "2"]
    code, promoted, _ = cli("keys", "promote", "2", "--config", cfg, "--json")
    assert code == 0 and promoted["current"] == "2" and promoted["previous"] == "1"
    code, _, err = cli("keys", "promote", "9", "--config", cfg, "--json")
    assert code == 2 and "key 9" in err
    material = profile.keys_file.read_text()
    code, out, err = cli("keys", "list", "--config", cfg)
    for line in material.splitlines():
        if " = \"" in line:
            secret = line.split('"')[1]
            assert secret not in out and secret not in err


@pytest.mark.parametrize(("old", "new", "setting"), [
    ("batch_size = 200", "batch_size = 0", "job.batch_size"),
    ("batch_size = 200", "batch_sise = 200", "job.batch_sise"),
    ('provider = "file"', 'provider = "nope"', "keys.provider"),
    ('key_version = "key_version"', 'key_version = ""', 'target "Person"'),
])
def test_bad_configuration_exits_2_naming_the_setting_and_touches_nothing(
        primary_database_url: str, tmp_path: Path, old: str, new: str, setting: str) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=10)
    good = profile.config_path.read_text()
    assert old in good
    bad = tmp_path / "bad.toml"
    bad.write_text(good.replace(old, new, 1))
    with psycopg.connect(primary_database_url) as conn:
        before = conn.execute("SELECT id, xmin::text FROM profile.persons ORDER BY id").fetchall()
    code, doc, err = cli("run", "--config", str(bad), "--json")
    assert code == 2, err
    assert setting in err and err.count("\n") <= 3
    assert doc["exit_code"] == 2
    with psycopg.connect(primary_database_url) as conn:
        assert conn.execute("SELECT id, xmin::text FROM profile.persons ORDER BY id").fetchall() == before


def test_missing_configuration_file_exits_2(tmp_path: Path) -> None:
    code, _, err = cli("inventory", "--config", str(tmp_path / "absent.toml"))
    assert code == 2 and "absent.toml" in err


def test_missing_table_exits_2_before_anything_is_written(primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=10)
    text = profile.config_path.read_text().replace("profile.requisite_templates", "profile.no_such_table")
    cfg = tmp_path / "missing.toml"
    cfg.write_text(text)
    code, _, err = cli("run", "--config", str(cfg), "--json", env={"PREFECT_API_URL": "http://127.0.0.1:9"})
    assert code == 2, err
    assert "profile.no_such_table" in err
    assert profile.key_versions("persons") == {1: 10}


def test_inventory_reports_a_missing_table_as_blocked(primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=10)
    cfg = tmp_path / "missing.toml"
    cfg.write_text(profile.config_path.read_text().replace("profile.requisite_templates", "profile.gone"))
    code, doc, _ = cli("inventory", "--config", str(cfg), "--json")
    assert code == 0
    assert doc["targets"]["RequisiteTemplate"]["BLOCKED"] == 1
    code, gate, _ = cli("gate", "--retire", "1", "--config", str(cfg), "--json")
    assert code == 3 and gate["blocking"]["BLOCKED"] == 1


def test_write_config_helper_round_trips(tmp_path: Path) -> None:
    from pinrotate_core.config import load_settings

    cfg = write_config(tmp_path / "c.toml", "postgresql://x@127.0.0.1/db", tmp_path / "k.toml", batch_size=7)
    settings = load_settings(cfg)
    assert settings.job.batch_size == 7 and [t.name for t in settings.targets][0] == "Person"
    assert json.dumps(settings.model_dump(), default=str)


def test_tenant_scope_on_targets_without_a_tenant_column_exits_2(primary_database_url: str, tmp_path: Path) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=4)
    for args in (["inventory", "--tenant", "t1"], ["gate", "--retire", "1", "--tenant", "t1"]):
        code, _, err = cli(*args, "--config", str(profile.config_path))
        assert code == 2 and "--tenant" in err and "Person" in err


@pytest.mark.parametrize("args", [["inventory"], ["inventory", "--deep"], ["gate", "--retire", "1"], ["keys", "list"],
                                  ["keys", "promote", "2"]], ids=["inventory", "inventory-deep", "gate", "keys-list",
                                                                  "keys-promote"])
def test_a_read_path_with_a_missing_keys_file_exits_2_naming_it_and_creates_no_keyring(
        primary_database_url: str, tmp_path: Path, args: list[str]) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=10)
    missing = tmp_path / "elsewhere" / "keys.toml"
    missing.parent.mkdir(mode=0o700)
    config = write_config(tmp_path / "other.toml", primary_database_url, missing)
    before = sorted(p.name for p in missing.parent.iterdir())

    code, _, err = cli(*args, "--config", str(config))

    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and str(missing) in lines[0] and "does not exist" in lines[0], err
    assert "Traceback" not in err
    assert not missing.exists()
    assert sorted(p.name for p in missing.parent.iterdir()) == before  # not even a lock file
    # The profile's own keyring and rows were not touched either.
    assert profile.keys_file.exists()


def test_keys_add_creates_the_first_keyring(tmp_path: Path, primary_database_url: str) -> None:
    keys_file = tmp_path / "k" / "keys.toml"
    config = write_config(tmp_path / "pinrotate.toml", primary_database_url, keys_file)
    code, doc, err = cli("keys", "add", "--config", str(config), "--json")
    assert code == 0, err
    assert keys_file.exists() and doc["current"] == "1"


def test_a_shard_task_on_a_host_without_the_keys_file_refuses_and_only_the_runs_first_start_creates_it(
        primary_database_url: str, tmp_path: Path) -> None:
    import uuid

    from flows.tasks import RunSpec, run_context
    from pinrotate_core.errors import ConfigError

    seed_profile(primary_database_url, tmp_path, rows=10)
    missing = tmp_path / "worker-host" / "keys.toml"
    missing.parent.mkdir(mode=0o700)
    config = write_config(tmp_path / "worker.toml", primary_database_url, missing)
    spec = RunSpec(config_path=str(config), run_id=str(uuid.uuid4()))

    # What drain_shard (and plan_shards, verify, the gate report) open on a Dask worker.
    with pytest.raises(ConfigError, match="does not exist") as refused, run_context(spec, ["Person"]):
        pass
    assert str(missing) in str(refused.value) and "\n" not in str(refused.value)
    assert not missing.exists() and not any(missing.parent.iterdir())

    # The run's first start (the read_current_key task) is where contract §3's "created on first use" holds.
    with run_context(spec, announce=True) as ctx:
        assert ctx.keyring is not None
    assert missing.exists()


def test_core_log_lines_outside_a_flow_run_reach_stderr_without_a_prefect_warning() -> None:
    # Prefect's API log handler sits on the `pinrotate` logger (PREFECT_LOGGING_EXTRA_LOGGERS); a line
    # logged outside a flow run used to raise one UserWarning per line (53 in a test session).
    script = ("import warnings; warnings.simplefilter('error')\n"
              "import flows\n"
              "from prefect.logging.configuration import setup_logging; setup_logging()\n"
              "from pinrotate_core.log import configure_stderr_logging, log_event\n"
              "configure_stderr_logging(); log_event('outside_a_run', target='T')\n")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "event=outside_a_run target=T" in proc.stderr
    assert "Warning" not in proc.stderr and "without a flow run id" not in proc.stderr
