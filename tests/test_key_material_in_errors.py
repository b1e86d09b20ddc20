"""No error, log line or report echoes text from a key source (issue 23, point 10).

For every provider, a damaged line or value that holds real key bytes (a key's base64 alone on a
line, a separator replaced by a no-break space, a key where an id belongs, an id that is a key's
hex) is refused, and the command's whole stdout and stderr are searched for the key in every form
it could take. Driven as an operator meets it: ``python -m flows.rotate inventory|run|gate``.
The keys are random TEST keys made here.
"""

from __future__ import annotations

import base64
import os
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.forge_bootstrap import bootstrap_props, java_store
from tests.pinprofile import cli_all
from tests.vault_server import BaoAdmin

COMMANDS = (("inventory",), ("run",), ("gate", "--retire", "1"))
NBSP = "\u00a0"


def forms(key: bytes) -> list[str]:
    """Every way the key could show up: base64 with and without padding, URL-safe, hex either case."""
    std = base64.b64encode(key).decode()
    url = base64.urlsafe_b64encode(key).decode()
    return [std, std.rstrip("="), url.rstrip("="), key.hex(), key.hex().upper()]


@dataclass
class Case:
    """A key source with one damaged line; ``key`` is the material that must not appear."""

    key: bytes
    keys: str  # the [keys] section of pinrotate.toml
    env: dict[str, str] = field(default_factory=dict)
    fmt: str = "aesgcm"
    names_line: int | None = None  # the line number the error must name


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _private(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(0o600)
    return path


# -- file provider (TOML keyring) -------------------------------------------------------------------

def _file(text: Callable[[str, str, bytes], str], line: int | None = None) -> Callable[[Path], Case]:
    def make(tmp: Path) -> Case:
        key = secrets.token_bytes(32)
        good = b64(secrets.token_bytes(32))
        path = _private(tmp / "keys" / "keys.toml", text(b64(key), good, key))
        return Case(key, f'provider = "file"\nfile = "{path}"\n', names_line=line)
    return make


FILE_CASES = {
    "file_key_alone_on_a_line": _file(lambda k, g, raw: f'current = 1\n[keys]\n1 = "{g}"\n{k}\n'),
    "file_separator_a_no_break_space": _file(lambda k, g, raw: f'current = 1\n[keys]\n1 = "{g}"\n2{NBSP}"{k}"\n'),
    "file_key_unquoted": _file(lambda k, g, raw: f'current = 1\n[keys]\n1 = "{g}"\n2 = {k}\n'),
    "file_key_as_a_key_id": _file(lambda k, g, raw: f'current = 1\n[keys]\n1 = "{g}"\n"{k}" = "{g}"\n'),
    "file_key_as_an_unknown_setting": _file(lambda k, g, raw: f'"{k}" = 1\ncurrent = 1\n[keys]\n1 = "{g}"\n', 1),
    "file_hex_key_as_current": _file(lambda k, g, raw: f'current = "{raw[:16].hex()}"\n[keys]\n1 = "{g}"\n'),
    "file_key_with_a_trailing_no_break_space": _file(
        lambda k, g, raw: f'current = 1\n[keys]\n1 = "{g}"\n2 = "{k}{NBSP}x"\n', 4),
}


# -- env provider --------------------------------------------------------------------------------------

def _env(values: Callable[[str, bytes], dict[str, str]]) -> Callable[[Path], Case]:
    def make(tmp: Path) -> Case:
        key = secrets.token_bytes(32)
        return Case(key, 'provider = "env"\n', env=values(b64(key), key))
    return make


GOOD = b64(secrets.token_bytes(32))
ENV_CASES = {
    "env_key_as_current": _env(lambda k, raw: {"PINROTATE_KEY_CURRENT": k, "PINROTATE_KEY_1": GOOD}),
    "env_key_with_a_no_break_space": _env(lambda k, raw: {"PINROTATE_KEY_CURRENT": "1", "PINROTATE_KEY_1": GOOD,
                                                          "PINROTATE_KEY_2": f"{k}{NBSP}x"}),
    "env_key_and_more_in_one_value": _env(lambda k, raw: {"PINROTATE_KEY_CURRENT": "1", "PINROTATE_KEY_1": f"{k} {GOOD}"}),
    "env_hex_key_as_current": _env(lambda k, raw: {"PINROTATE_KEY_CURRENT": raw[:16].hex(), "PINROTATE_KEY_1": GOOD}),
    "env_hex_key_in_a_variable_name": _env(lambda k, raw: {"PINROTATE_KEY_CURRENT": "1", "PINROTATE_KEY_1": GOOD,
                                                           f"PINROTATE_KEY_{raw[:16].hex()}": "not base64!"}),
}


# -- k8s-dir provider ----------------------------------------------------------------------------------

def _k8s(files: Callable[[str, bytes], dict[str, str]]) -> Callable[[Path], Case]:
    def make(tmp: Path) -> Case:
        key = secrets.token_bytes(32)
        folder = tmp / "secret"
        for name, text in files(b64(key), key).items():
            _private(folder / name, text)
        return Case(key, f'provider = "k8s-dir"\ndir = "{folder}"\n')
    return make


K8S_CASES = {
    "k8s_key_in_the_current_file": _k8s(lambda k, raw: {"current": k, "1": GOOD}),
    "k8s_key_with_a_no_break_space": _k8s(lambda k, raw: {"current": "1", "1": f"{k}{NBSP}x"}),
    "k8s_hex_key_as_current": _k8s(lambda k, raw: {"current": raw[:16].hex(), "1": GOOD}),
    "k8s_hex_key_as_a_file_name": _k8s(lambda k, raw: {"current": "1", "1": GOOD, raw[:16].hex(): "not base64!"}),
}


# -- forge provider: the bootstrap file and FORGE_CRYPTO_PERSISTENCE_* -----------------------------------

P = "forge.crypto.persistence."


def _forge(damage: Callable[[str, bytes], str] | None = None, env: Callable[[str, bytes], dict[str, str]] | None = None,
           line: int | None = None) -> Callable[[Path], Case]:
    def make(tmp: Path) -> Case:
        key = secrets.token_bytes(16)
        active = secrets.token_bytes(16)
        text = java_store(bootstrap_props("k1", active)).decode("iso-8859-1")
        if damage is not None:
            text += damage(b64(key), key)
        path = _private(tmp / "forge" / "crypto.properties", text.encode("iso-8859-1"))
        return Case(key, f'provider = "forge"\nfile = "{path}"\n', env=env(b64(key), key) if env else {},
                    fmt="fpc1", names_line=line)
    return make


# java_store writes 2 comment lines and 6 settings: the damaged line is line 9.
FORGE_CASES = {
    "forge_key_alone_on_a_line": _forge(lambda k, raw: f"{k}\n", line=9),
    "forge_key_alone_unpadded": _forge(lambda k, raw: f"{k.rstrip('=')}\n", line=9),
    "forge_separator_a_no_break_space": _forge(lambda k, raw: f"{P}keys.k3{NBSP}{k}\n", line=9),
    "forge_key_where_the_id_belongs": _forge(lambda k, raw: f"{P}keys.{k}=x\n", line=9),
    "forge_hex_key_where_the_id_belongs": _forge(lambda k, raw: f"{P}keys.{raw.hex()}=x\n", line=9),
    "forge_key_with_a_no_break_space_value": _forge(lambda k, raw: f"{P}keys.k3={k}{NBSP}x\n", line=9),
    "forge_env_key_as_the_active_id": _forge(env=lambda k, raw: {"FORGE_CRYPTO_PERSISTENCE_ACTIVE_KEY_ID": k}),
    "forge_env_key_with_a_no_break_space": _forge(
        env=lambda k, raw: {"FORGE_CRYPTO_PERSISTENCE_ACTIVE_KEY": f"{k}{NBSP}x"}),
    "forge_env_key_as_a_switch": _forge(env=lambda k, raw: {"FORGE_CRYPTO_PERSISTENCE_ENABLED": k}),
    "forge_env_hex_key_in_a_variable_name": _forge(
        env=lambda k, raw: {f"FORGE_CRYPTO_PERSISTENCE_KEYS_{raw.hex().upper()}": "not base64!"}),
}

CASES = {**FILE_CASES, **ENV_CASES, **K8S_CASES, **FORGE_CASES}


def _config(tmp: Path, url: str, case: Case) -> Path:
    target = ('[[targets]]\nname = "Person"\ntable = "persons"\nkey_version = "key_version"\ncolumns = ["c"]\n'
              if case.fmt == "aesgcm" else
              '[[targets]]\nname = "Connection"\ntable = "data_connections"\nformat = "fpc1"\ncolumns = ["password"]\n')
    path = tmp / "pinrotate.toml"
    path.write_text(f'[database]\nurl = "{url}"\n\n[keys]\n{case.keys}\n{target}', encoding="utf-8")
    return path


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    # No key variable of the outer environment may leak in (the CLI helper overlays os.environ).
    return {**{k: "" for k in os.environ if k.startswith(("PINROTATE_KEY_", "FORGE_CRYPTO_"))}, **extra}


def run_commands(config: Path, env: dict[str, str]) -> list[tuple[int, Any, str]]:
    """(exit code, stdout, stderr) of each of COMMANDS on ``config``, in COMMANDS' order: each its
    own process, started together (they only read and are refused)."""
    return cli_all([[*command, "--config", str(config)] for command in COMMANDS], env=env, check_json=False)


def assert_refused_without_the_key(code: int, out: Any, err: str, key: bytes, line: int | None = None) -> None:
    text = f"{out}\n{err}"
    assert code in (2, 4), text[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [x for x in err.splitlines() if x.startswith("pinrotate: error:")]
    assert len(errors) == 1, err[-3000:]
    if line is not None:
        assert f"line {line}" in errors[0], errors[0]
    for form in forms(key):
        # Not even a part of it: any 16 characters of its base64 or hex (a message once cut a name at 40).
        for i in range(len(form) - 15):
            assert form[i:i + 16] not in text, f"the key appears in the output of a refused command: {errors[0]}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_key_source_is_refused_without_echoing_the_key(
        case: str, primary_database_url: str, tmp_path: Path) -> None:
    spec = CASES[case](tmp_path)
    config = _config(tmp_path, primary_database_url, spec)
    for code, out, err in run_commands(config, _clean_env(spec.env)):
        assert_refused_without_the_key(code, out, err, spec.key, spec.names_line)


# -- vault-kv: fields of a KV v2 secret ---------------------------------------------------------------

VAULT_FIELDS: dict[str, Callable[[str, bytes], dict[str, str]]] = {
    "vault_key_as_a_field_name": lambda k, raw: {"current": "1", "1": GOOD, k: GOOD},
    "vault_key_as_current": lambda k, raw: {"current": k, "1": GOOD},
    "vault_key_with_a_no_break_space": lambda k, raw: {"current": "1", "1": f"{k}{NBSP}x"},
    "vault_hex_key_as_current": lambda k, raw: {"current": raw[:16].hex(), "1": GOOD},
}


@pytest.mark.vault
@pytest.mark.parametrize("case", sorted(VAULT_FIELDS))
def test_a_damaged_vault_kv_secret_is_refused_without_echoing_the_key(
        case: str, primary_database_url: str, tmp_path: Path, openbao: Any) -> None:
    key = secrets.token_bytes(32)
    path = f"pinrotate-leak-{uuid.uuid4().hex[:8]}"
    BaoAdmin.of(openbao).kv_put("secret", path, dict(VAULT_FIELDS[case](b64(key), key)))
    spec = Case(key, f'provider = "vault-kv"\n[keys.vault]\naddr = "{openbao.addr}"\nmount = "secret"\n'
                     f'path = "{path}"\n')
    config = _config(tmp_path, primary_database_url, spec)
    for code, out, err in run_commands(config, _clean_env({"VAULT_TOKEN": openbao.token})):
        assert_refused_without_the_key(code, out, err, key)
