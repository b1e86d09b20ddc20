"""Test helpers for the Pin profile preset: a seeded database, its configuration file, and CLI runs.

On a MySQL / MariaDB URL the same: examples/pin-profile-mysql.toml's targets, the rows loaded by
``seed``'s own MySQL path (its four tables in the URL's database).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import psycopg
import pymysql

from pinrotate_core.commands import commands_for
from pinrotate_core.config import load_settings
from pinrotate_core.engines import engine_of_url
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.samples import pin_profile as presets

REPO = Path(__file__).resolve().parents[1]


@dataclass
class PinProfile:
    url: str
    config_path: Path
    keys_file: Path
    summary: presets.SeedSummary

    def provider(self) -> FileKeyProvider:
        return FileKeyProvider(self.keys_file, create=True)

    def key_versions(self, table: str) -> dict[Any, int]:
        if engine_of_url(self.url) == "mysql":
            u = urlsplit(self.url)
            with contextlib.closing(pymysql.connect(host=u.hostname, port=u.port or 3306, user=unquote(u.username or ""),
                                                    password=unquote(u.password or ""), database=u.path.lstrip("/"))) \
                    as conn, conn.cursor() as cur:
                cur.execute(f"SELECT key_version, count(*) FROM {table} GROUP BY 1")
                return {row[0]: int(row[1]) for row in cur.fetchall()}
        with psycopg.connect(self.url) as conn:
            return dict(conn.execute(f"SELECT key_version, count(*) FROM profile.{table} GROUP BY 1").fetchall())


def write_config(path: Path, url: str, keys_file: Path, **job: Any) -> Path:
    preset = presets.PIN_PROFILE_TOML
    if engine_of_url(url) == "mysql":
        preset = preset.with_name("pin-profile-mysql.toml")
    raw = tomllib.loads(preset.read_text(encoding="utf-8"))
    lines = [f'[database]\nurl = "{url}"\n', f'[keys]\nprovider = "file"\nfile = "{keys_file}"\n', "[job]"]
    settings = {**raw["job"], **job}
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    for t in raw["targets"]:
        lines.append("\n[[targets]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in t.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def seed_profile(url: str, tmp: Path, *, rows: int, promote: bool = True, **job: Any) -> PinProfile:
    """Schema + ``rows`` persons (and the other tables) under key 1; key 2 added and promoted."""
    keys_file = tmp / "keys" / "keys.toml"
    provider = FileKeyProvider(keys_file, create=True)
    ring = provider.load_keyring()
    config = write_config(tmp / "pinrotate.toml", url, keys_file, **job)
    if engine_of_url(url) == "mysql":  # seed's own path for the engine
        summary = commands_for(url).seed_pin_profile(load_settings(str(config)), ring, rows=rows, key_id="1")
    else:
        with psycopg.connect(url, autocommit=True) as conn:
            presets.apply_pin_profile_schema(conn)
            summary = presets.seed_pin_profile(conn, ring, rows=rows, key_id="1", seed=7)
    if promote:
        provider.add_key()
        provider.promote("2")
    return PinProfile(url, config, keys_file, summary)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180,
        check_json: bool = True) -> tuple[int, Any, str]:
    """Run ``python -m flows.rotate ARGS``; returns (exit code, parsed stdout JSON or text, stderr).

    A ``run`` without ``PREFECT_API_URL`` in the worker's own ``PINROTATE_HOME`` reuses the Prefect
    server of that home (``PINROTATE_PREFECT_SERVER=reuse``, flows/adhoc_server.py; stopped at the
    session's end by conftest) instead of starting a temporary one: about 6 s of CPU a run less.
    An ``env`` that names ``PINROTATE_PREFECT_SERVER`` or another home keeps what it says (the
    temporary server's own tests start their commands themselves)."""
    full_env = {**os.environ, **(env or {})}
    if "PINROTATE_PREFECT_SERVER" not in (env or {}) and not full_env.get("PREFECT_API_URL") \
            and full_env.get("PINROTATE_HOME") == os.environ.get("PINROTATE_HOME"):
        full_env["PINROTATE_PREFECT_SERVER"] = "reuse"
    proc = subprocess.run([sys.executable, "-m", "flows.rotate", *args], cwd=REPO, env=full_env, check=False,
                          capture_output=True, text=True, timeout=timeout)
    out: Any = proc.stdout
    if check_json and "--json" in args:
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        assert len(lines) == 1, f"--json must print exactly one line on stdout, got: {proc.stdout!r}\n{proc.stderr}"
        out = json.loads(lines[0])
    return proc.returncode, out, proc.stderr


def cli_all(commands: Sequence[Sequence[str]], env: dict[str, str] | None = None, timeout: float = 180,
            check_json: bool = True) -> list[tuple[int, Any, str]]:
    """``cli`` for each of ``commands``, all started at once; the results in ``commands``' order.

    Only for commands that cannot affect each other (reads, refusals): each is still its own
    ``python -m flows.rotate`` process, and most of one is the interpreter's start and imports,
    which the machine's other core does meanwhile.
    """
    with ThreadPoolExecutor(max_workers=min(len(commands), 4) or 1) as pool:
        futures = [pool.submit(cli, *command, env=env, timeout=timeout, check_json=check_json)
                   for command in commands]
        return [f.result() for f in futures]
