"""The CLI's link to its Prefect API before a run: one request, so that refused credentials and an
unreachable server are one line each; and, without ``PREFECT_API_URL``, the run's temporary server.

A Prefect server started with ``PREFECT_SERVER_API_AUTH_STRING`` answers 401 to every client
without the same ``PREFECT_API_AUTH_STRING``; without this check the run would end in Prefect's
traceback (exit 1). Nothing here reads or prints the auth string itself.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from flows.server_process import TemporaryServerFailed, free_port, server_log_path, spawn_server
from pinrotate_core.errors import ConfigError, PinrotateError

AUTH_HINT = ("set PREFECT_API_AUTH_STRING to the server's PREFECT_SERVER_API_AUTH_STRING "
             "(docs/reference.md, \"Who may start a rotation\")")


class PrefectApiUnreachable(PinrotateError):
    """The Prefect API behind ``PREFECT_API_URL`` does not answer: exit 4, one line, nothing run."""


def unreachable_message(url: str, why: str) -> str:
    """One line: which API, what happened, and the two ways on."""
    return (f"cannot reach the Prefect API at {url} ({why}): start that server, or `unset PREFECT_API_URL` "
            "for an ad hoc run (pinrotate then starts a temporary Prefect server of its own)")


def api_lost_message(what: str, *, temporary: bool) -> str:
    """The one line of a run that lost its Prefect API mid-run: ``what`` happened, at which URL, and
    what to do."""
    if temporary:  # the run's own server, or the one ad hoc runs share (it starts again on the next run)
        return f"{what} (the run's temporary Prefect server stopped): run the command again"
    from prefect.settings import PREFECT_API_URL

    return (f"{what} (the Prefect API at {PREFECT_API_URL.value()}): start that server again, or "
            "`unset PREFECT_API_URL` for an ad hoc run")


def check_prefect_api() -> None:
    """With ``PREFECT_API_URL`` set, ask the server its version (an authenticated endpoint).

    Credentials refused (401/403): ``ConfigError`` (exit 2), nothing run. A server that cannot be
    reached (refused, timed out, no such host): ``PrefectApiUnreachable`` (exit 4), nothing run.
    """
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import (
        PREFECT_API_REQUEST_TIMEOUT,
        PREFECT_API_URL,
        PREFECT_CLIENT_MAX_RETRIES,
        temporary_settings,
    )

    url = PREFECT_API_URL.value()
    if not url:
        return  # the run's temporary server (temporary_server) answers
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 1, PREFECT_API_REQUEST_TIMEOUT: 15.0}), \
            get_client(sync_client=True) as client:
        try:
            client.api_version()
        except httpx.TransportError as e:
            raise PrefectApiUnreachable(unreachable_message(url, type(e).__name__)) from None
        except PrefectHTTPStatusError as e:
            status = e.response.status_code
            if status in (401, 403):
                raise ConfigError(f"the Prefect API at {url} refused the credentials (HTTP {status}): "
                                  f"{AUTH_HINT}") from None
            raise PrefectApiUnreachable(unreachable_message(url, f"HTTP {status}")) from None


# -- the temporary server of an ad hoc run ------------------------------------------------------------

READY_POLL_S = 0.02  # asked this often whether the temporary server answers (Prefect asks every 0.1 s)


def _own_session_server(port: int, early: subprocess.Popen[Any]) -> Any:
    from prefect.server.api.server import SubprocessASGIServer

    class OwnSessionServer(SubprocessASGIServer):
        """Prefect's temporary server, started in a session of its own: a Ctrl-C at the terminal
        reaches the whole foreground process group, and the run needs its server to record the stop
        it asked for (before, SIGINT killed the server and the run hung for minutes). Its process
        was spawned before (``early``): ``start`` waits for it to answer, as Prefect's does."""

        early: subprocess.Popen[Any] | None = None
        previous: Any = None  # the server registered under port None before this one, if any

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            if self.early is not None:  # Prefect's start() takes the process spawned before
                spawned, self.early = self.early, None
                return spawned
            assert self.port is not None
            return spawn_server(self.port)  # the port was taken meanwhile (exit 3): another one

        def start(self, timeout: int | None = None) -> None:
            """Prefect's start, but a server process that exits (other than for a port taken
            meanwhile, which Prefect handles) is a one-line error at once, not minutes of waiting."""
            import httpx

            early = self.early
            while early is not None:
                code = early.poll()
                if code is not None and code != 3:
                    raise TemporaryServerFailed(f"the temporary Prefect server of this run exited with code {code} "
                                                f"before it answered; its output is in {server_log_path()}")
                try:
                    if httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200 or code == 3:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(READY_POLL_S)
            super().start(timeout)

        def stop(self) -> None:
            if self.early is not None:  # spawned, never started: the run refused to start
                self.server_process, self.early = self.early, None
            super().stop()

    previous = SubprocessASGIServer._instances.pop(None, None)
    server = OwnSessionServer()  # registered under port None: Prefect's clients find it
    server.port, server.early, server.previous = port, early, previous
    return server


def _flush_to(server: Any, timeout: float = 10.0) -> None:
    """Send Prefect's queued log lines and events while the server still answers: stopped first,
    the workers would retry against it for over a minute at the process's exit."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    if server.running:
        for worker in (APILogWorker, EventsWorker):
            worker.drain_all(timeout=timeout, at_exit=False)


class EarlyServer:
    """Without ``PREFECT_API_URL`` in the environment, the run's Prefect server, asked for at once
    without importing Prefect here: its start-up (seconds of its own imports) overlaps the run's
    checks, and a run those checks refuse costs no Prefect import at all (before, a refused run
    imported Prefect and its server code: about 10 s of CPU).

    Either ``shared`` (flows.adhoc_server: the server that ad hoc runs at a terminal reuse, whose
    URL is then this process's ``PREFECT_API_URL``) or ``process`` (a temporary server of the run's
    own). Neither with the variable set."""

    def __init__(self, json_output: bool = False, reusable: bool = True) -> None:
        from flows import adhoc_server

        self.port = free_port()
        self.process: subprocess.Popen[Any] | None = None
        self.shared: adhoc_server.SharedServer | None = None
        if os.environ.get("PREFECT_API_URL"):
            return
        if reusable and adhoc_server.mode(json_output) == "reuse":
            self.shared = adhoc_server.attach()
            if self.shared is not None:
                os.environ["PREFECT_API_URL"] = self.shared.url  # before Prefect is imported: all of it uses it
                return
        self.process = spawn_server(self.port)

    def take(self) -> subprocess.Popen[Any] | None:
        process, self.process = self.process, None
        return process

    def discard(self) -> None:
        process = self.take()
        if process is not None:
            process.terminate()
            process.wait()
        if self.shared is not None:
            self.shared.stop()


@contextlib.contextmanager
def early_server(json_output: bool = False, reusable: bool = True) -> Iterator[EarlyServer]:
    """The run's server (``EarlyServer``): a spawned temporary one is terminated when the block ends
    unless ``temporary_server`` took it; a shared one is released (it stays up)."""
    early = EarlyServer(json_output, reusable)
    try:
        yield early
    finally:
        early.discard()


@contextlib.contextmanager
def temporary_server(early: EarlyServer | None = None) -> Iterator[Any]:
    """Without ``PREFECT_API_URL``: the temporary Prefect server of this run (yielded), in its own
    session, registered where Prefect looks for its ephemeral server, and stopped when the block
    ends (after the run has reported). Its process is ``early``'s, or one spawned here before
    Prefect's server code is imported; the caller's ``server.start()`` waits until it answers
    (called just before the flow, so that the server's start-up overlaps what comes before). With
    ``PREFECT_API_URL``: None. A shared server (``early.shared``) is yielded as it is: its
    ``start()`` waits until it answers, and it is released, never stopped, when the block ends."""
    with contextlib.ExitStack() as stack:
        if early is None:  # the demo's: always a server of its own, gone with its sandbox
            early = stack.enter_context(early_server(reusable=False))
        if early.shared is not None:
            try:
                yield early.shared
            finally:
                early.shared.stop()
            return
        # A PREFECT_API_URL from a Prefect profile, read here, stops the spawned process again.
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

        if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
            early.discard()
            yield None
            return
        process = early.take()
        server = _own_session_server(early.port, process if process is not None else spawn_server(early.port))
        try:
            yield server
        finally:
            _flush_to(server)
            server.stop()
            if server.previous is not None:
                type(server)._instances[None] = server.previous
