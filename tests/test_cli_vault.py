"""The command line with keys in Vault / OpenBao: keys add / promote / list / rotate, run, gate."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest

from tests.pinprofile import cli, write_config
from tests.vault_server import BaoAdmin

pytestmark = pytest.mark.vault


def _config(tmp_path: Path, body: str) -> Path:
    """A Pin profile configuration whose [keys] section is ``body`` (no database is needed for keys)."""
    base = write_config(tmp_path / "base.toml", "postgresql://nobody@127.0.0.1:1/none", tmp_path / "unused.toml")
    text = base.read_text()
    start = text.index("[keys]")
    end = text.index("[job]")
    cfg = tmp_path / "pinrotate.toml"
    cfg.write_text(text[:start] + body + "\n" + text[end:])
    return cfg


def _env(server: Any) -> dict[str, str]:
    return {"VAULT_ADDR": server.addr, "VAULT_TOKEN": server.token}


def test_vault_kv_keys_are_added_read_only_then_promoted(openbao: Any, tmp_path: Path) -> None:
    path = f"pinrotate-cli-{secrets.token_hex(4)}"
    cfg = _config(tmp_path, f'[keys]\nprovider = "vault-kv"\n[keys.vault]\nmount = "secret"\npath = "{path}"\n')
    env = _env(openbao)
    code, first, err = cli("keys", "add", "--config", str(cfg), "--json", env=env)
    assert code == 0, err
    assert first["added"] == "1"  # a new secret starts with its first key current
    code, second, err = cli("keys", "add", "--config", str(cfg), "--json", env=env)
    assert code == 0 and second["added"] == "2" and second["current"] == "1", err
    code, listed, _ = cli("keys", "list", "--config", str(cfg), "--json", env=env)
    assert listed["current"] == "1" and listed["keys"] == ["1", "2"]
    assert listed["provider"] == f"vault-kv secret/{path}"
    code, promoted, err = cli("keys", "promote", "2", "--config", str(cfg), "--json", env=env)
    assert code == 0 and promoted["current"] == "2" and promoted["previous"] == "1", err
    stored = BaoAdmin.of(openbao).api("GET", f"secret/data/{path}")["data"]["data"]
    assert stored["current"] in ("2", 2)
    code, out, err = cli("keys", "list", "--config", str(cfg), env=env)
    for secret in (openbao.token, stored["1"], stored["2"]):
        assert secret not in out and secret not in err


def test_keys_promote_of_a_missing_vault_field_exits_2(openbao: Any, tmp_path: Path) -> None:
    path = f"pinrotate-cli-{secrets.token_hex(4)}"
    cfg = _config(tmp_path, f'[keys]\nprovider = "vault-kv"\n[keys.vault]\nmount = "secret"\npath = "{path}"\n')
    assert cli("keys", "add", "--config", str(cfg), env=_env(openbao))[0] == 0
    code, _, err = cli("keys", "promote", "7", "--config", str(cfg), env=_env(openbao))
    assert code == 2 and "7" in err


def test_transit_keys_rotate_creates_a_new_latest_version(openbao: Any, tmp_path: Path) -> None:
    mount = f"transit-cli-{secrets.token_hex(4)}"
    admin = BaoAdmin.of(openbao)
    admin.enable_secrets(mount, "transit")
    admin.api("POST", f"{mount}/keys/pii", {"type": "aes256-gcm96"})
    cfg = _config(tmp_path, f'[keys]\nprovider = "vault-transit"\n[keys.vault]\ntransit_mount = "{mount}"\nkey = "pii"\n')
    code, rotated, err = cli("keys", "rotate", "--config", str(cfg), "--json", env=_env(openbao))
    assert code == 0 and rotated["latest_version"] == 2, err
    code, listed, err = cli("keys", "list", "--config", str(cfg), "--json", env=_env(openbao))
    assert code == 0 and listed["current"] == "2", err
    code, _, err = cli("keys", "add", "--config", str(cfg), env=_env(openbao))
    assert code == 2 and "managed outside pinrotate" in err


def test_an_unreachable_vault_exits_4_without_the_token(tmp_path: Path) -> None:
    cfg = _config(tmp_path, '[keys]\nprovider = "vault-kv"\n[keys.vault]\nmount = "secret"\npath = "p"\n')
    token = "s." + secrets.token_hex(12)
    code, _, err = cli("inventory", "--config", str(cfg), env={"VAULT_ADDR": "http://127.0.0.1:9", "VAULT_TOKEN": token})
    assert code == 4, err
    assert "127.0.0.1:9" in err and token not in err
