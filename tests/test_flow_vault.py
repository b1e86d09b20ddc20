"""The flow's retry policy against a real OpenBao: outages are retried with backoff, a 403 is not."""

from __future__ import annotations

import base64
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.samples import pin_profile as presets
from tests.pinprofile import write_config
from tests.prefect_reads import recorded_task_runs
from tests.vault_server import BaoAdmin

pytestmark = pytest.mark.vault


def _kv_config(tmp_path: Path, url: str, path: str) -> Path:
    base = write_config(tmp_path / "base.toml", url, tmp_path / "unused.toml", batch_size=50, inter_batch_delay=0)
    text = base.read_text()
    keys = f'[keys]\nprovider = "vault-kv"\n[keys.vault]\nmount = "secret"\npath = "{path}"\ntimeout = 2\n'
    cfg = tmp_path / "pinrotate.toml"
    cfg.write_text(text[:text.index("[keys]")] + keys + "\n" + text[text.index("[job]"):])
    return cfg


@pytest.fixture
def vault_env(openbao_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, dict[str, str]]]:
    """A private server whose address and token reach the flow through the environment, as in production."""
    server = openbao_factory()
    env = {"VAULT_ADDR": server.addr, "VAULT_TOKEN": server.token}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield server, env


def _seed(url: str, server: Any, path: str) -> dict[str, str]:
    """Keys 1 and 2 in Vault KV (current 2) and the Pin preset's rows under key 1."""
    material = {kid: secrets.token_bytes(32) for kid in ("1", "2")}
    secret = {"current": "2", **{k: base64.b64encode(v).decode() for k, v in material.items()}}
    BaoAdmin.of(server).kv_put("secret", path, secret)
    ring = Keyring(current="1", keys={k: Key(k, v) for k, v in material.items()}, source="test")
    with psycopg.connect(url, autocommit=True) as conn:
        presets.apply_pin_profile_schema(conn)
        presets.seed_pin_profile(conn, ring, rows=40, key_id="1", seed=3)
    return secret


def _task_runs(flow_run_id: str, name: str) -> list[Any]:
    return recorded_task_runs(flow_run_id, name_like=name)


def test_a_vault_outage_at_the_start_is_retried_with_backoff_and_the_run_completes(
        prefect_api: str, primary_database_url: str, tmp_path: Path, vault_env: tuple[Any, dict[str, str]]) -> None:
    from flows.rotate import pinrotate_rotate

    server, _ = vault_env
    path = f"pinrotate-retry-{secrets.token_hex(4)}"
    secret = _seed(primary_database_url, server, path)
    cfg = _kv_config(tmp_path, primary_database_url, path)
    server.stop()
    first_attempt_failed = threading.Event()

    def bring_back() -> None:
        # The dev server keeps its data in memory: it comes back empty, so the secret is put again.
        first_attempt_failed.wait(60)
        server.start()
        BaoAdmin.of(server).kv_put("secret", path, secret)

    import logging

    class _Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "vault_request_failed" in record.getMessage():
                first_attempt_failed.set()

    watch = _Watch()
    logging.getLogger("pinrotate").addHandler(watch)
    helper = threading.Thread(target=bring_back, daemon=True)
    helper.start()
    try:
        report = pinrotate_rotate(config_path=str(cfg))
    finally:
        logging.getLogger("pinrotate").removeHandler(watch)
        helper.join(60)
    assert report["exit_code"] == 0
    assert report["targets"]["Person"]["reencrypted"] == 40
    (read_key,) = _task_runs(report["run_id"], "read_current_key")
    assert read_key.run_count >= 2  # failed while the server was down, retried after a backoff


def test_a_revoked_token_is_not_retried_and_the_run_fails_closed(
        prefect_api: str, primary_database_url: str, tmp_path: Path, vault_env: tuple[Any, dict[str, str]]) -> None:
    from flows.rotate import run_flow

    server, _ = vault_env
    path = f"pinrotate-403-{secrets.token_hex(4)}"
    _seed(primary_database_url, server, path)
    cfg = _kv_config(tmp_path, primary_database_url, path)
    admin = BaoAdmin.of(server)
    token = admin.create_token(["default"])
    admin.revoke_token(token)
    os.environ["VAULT_TOKEN"] = token  # monkeypatch restores it
    outcome = run_flow(config_path=str(cfg))
    state = outcome.state
    assert outcome.report is None and outcome.exit_code == 4 and state is not None and state.is_failed()
    flow_run_id = str(state.state_details.flow_run_id)
    (read_key,) = _task_runs(flow_run_id, "read_current_key")
    assert read_key.run_count == 1  # a 403 is final: no retry
    assert token not in (state.message or "")
    with psycopg.connect(primary_database_url) as conn:
        assert conn.execute("SELECT count(*) FROM profile.persons WHERE key_version <> 1").fetchone() == (0,)
