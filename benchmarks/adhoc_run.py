"""Where the time of an ad hoc ``run`` with nothing to do goes (issue 33, point 7).

    python benchmarks/adhoc_run.py                 # 5 rounds, embedded PostgreSQL, 100 persons
    python benchmarks/adhoc_run.py --repeat 3 --database-url postgresql://...

Prints figures, asserts nothing. Every figure is the wall time of fresh processes (medians over
``--repeat`` rounds, taken in turns so that a busy moment of the machine spreads over all of them):

- ``python -c pass``: the interpreter alone;
- ``import flows.cli``: what every command loads (no Prefect);
- ``import flows.flow``: Prefect's client and the flow's modules (``run`` loads them while its
  temporary server starts);
- ``temporary server``: from spawning the run's temporary Prefect server (``flows.prefect_api``)
  until it answers ``/health``, alone in a process of its own (its SQLite database already made,
  as from a user's second run on);
- ``run, no PREFECT_API_URL``: ``python -m flows.rotate run`` with nothing to do, the temporary
  server started and stopped by the run (the case of the issue: 9.5 s);
- ``run, PREFECT_API_URL``: the same run against a Prefect server already running (4.0 s in the issue);
- ``run, reused server``: the same run with ``PINROTATE_PREFECT_SERVER=reuse`` (what a run at a
  terminal does), the shared server already up from an earlier run (flows/adhoc_server.py);
- ``run refused (damaged keyring)``: a run its checks refuse (exit 2), no ``PREFECT_API_URL``.

The database holds the Pin profile sample with every row on the current key: the run plans,
finds nothing to move, verifies and reports; it is the fixed cost of a run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pinrotate_core.db import embedded_server
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.samples import pin_profile


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home / "prefect"), PINROTATE_HOME=str(home / "pinrotate"), **extra)
    return env


def _timed(args: list[str], env: dict[str, str], expect: int = 0) -> float:
    began = time.perf_counter()
    proc = subprocess.run(args, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - began
    if proc.returncode != expect:
        raise SystemExit(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return took


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_health(url: str, proc: subprocess.Popen[Any], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.02)
    raise SystemExit("the server did not answer")


TEMPORARY_SERVER = """
import sys, time, urllib.request
began = time.perf_counter()
from flows.server_process import free_port, spawn_server
port = free_port()
proc = spawn_server(port)
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if proc.poll() is not None:
        sys.exit(f"exited {proc.returncode}")
    time.sleep(0.02)
print(time.perf_counter() - began)
proc.terminate()
proc.wait()
"""


@contextlib.contextmanager
def prefect_server(home: Path) -> Iterator[str]:
    """A ``prefect server start`` of its own (the ``PREFECT_API_URL`` case); its API URL."""
    port = free_port()
    env = _env(home, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_UI_ENABLED="false")
    log = open(home / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        _wait_health(url, proc)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def seed(url: str, home: Path, rows: int) -> Path:
    """The Pin profile sample, every row on the current key (key 1): a run with nothing to do."""
    keys_file = home / "keys.toml"
    ring = FileKeyProvider(keys_file, create=True).load_keyring()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS profile CASCADE")
        conn.execute("DROP SCHEMA IF EXISTS pinrotate CASCADE")
        pin_profile.apply_pin_profile_schema(conn)
        pin_profile.seed_pin_profile(conn, ring, rows=rows, key_id="1", seed=7)
    raw = tomllib.loads(pin_profile.PIN_PROFILE_TOML.read_text(encoding="utf-8"))
    lines = [f'[database]\nurl = "{url}"\n', f'[keys]\nprovider = "file"\nfile = "{keys_file}"\n', "[job]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in raw["job"].items()]
    for t in raw["targets"]:
        lines.append("\n[[targets]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in t.items()]
    config = home / "pinrotate.toml"
    config.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return config


def stop_shared_server(home: Path) -> None:
    """SIGTERM to the keeper of the shared server the reuse figure started (it stops its server)."""
    state = home / "pinrotate" / "prefect-server" / "server.json"
    with contextlib.suppress(OSError, ValueError, ProcessLookupError):
        os.kill(json.loads(state.read_text())["pid"], signal.SIGTERM)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of every figure (default 5)")
    ap.add_argument("--rows", type=int, default=100, help="sample persons (default 100)")
    ap.add_argument("--database-url", help="a database of one's own (its schemas profile and pinrotate are "
                                           "dropped and made again); default: embedded PostgreSQL, temporary")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="pinrotate-adhoc-bench-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, home, ignore_errors=True)
        if args.database_url:
            url = args.database_url
        else:
            server = embedded_server(home / "pgdata", cleanup_mode="delete")
            stack.callback(server.cleanup)
            url = server.get_uri()
        config = seed(url, home, args.rows)
        env = _env(home, PINROTATE_PREFECT_SERVER="temporary")
        py = sys.executable
        run = [py, "-m", "flows.rotate", "run", "--config", str(config), "--json"]
        damaged = home / "damaged.toml"
        damaged.write_text(config.read_text().replace(str(home / "keys.toml"), str(home / "damaged-keys.toml")))
        (home / "damaged-keys.toml").write_text("not a keyring line\n")
        (home / "damaged-keys.toml").chmod(0o600)
        refused = [py, "-m", "flows.rotate", "run", "--config", str(damaged)]
        reuse = {**env, "PINROTATE_PREFECT_SERVER": "reuse"}
        stack.callback(stop_shared_server, home)
        # A first run makes the temporary server's SQLite database (migrations): a user pays it once.
        first = _timed(run, env)
        api_url = stack.enter_context(prefect_server(home))
        figures: dict[str, Callable[[], float]] = {
            "python -c pass": lambda: _timed([py, "-c", "pass"], env),
            "import flows.cli": lambda: _timed([py, "-c", "import flows.cli"], env),
            "import flows.flow": lambda: _timed([py, "-c", "import flows.flow"], env),
            "temporary server to /health": lambda: float(subprocess.run(
                [py, "-c", TEMPORARY_SERVER], cwd=REPO, env=env, capture_output=True, text=True, check=True,
                timeout=600).stdout.strip().splitlines()[-1]),
            "run, no PREFECT_API_URL": lambda: _timed(run, env),
            "run, PREFECT_API_URL": lambda: _timed(run, {**env, "PREFECT_API_URL": api_url}),
            "run, reused server (PINROTATE_PREFECT_SERVER=reuse)": lambda: _timed(run, reuse),
            "run refused (damaged keyring), no PREFECT_API_URL": lambda: _timed(refused, env, expect=2),
        }
        _timed(run, reuse)  # starts the shared server: the figure is every run after the first
        seen: dict[str, list[float]] = {name: [] for name in figures}
        for _ in range(args.repeat):
            for name, figure in figures.items():
                seen[name].append(figure())
    print(f"ad hoc run with nothing to do ({args.rows} persons, {args.repeat} rounds, {os.cpu_count()} cores)")
    print(f"  {'first run, no PREFECT_API_URL (makes the SQLite database)':<60} {first:6.2f} s")
    for name, values in seen.items():
        print(f"  {name:<60} {statistics.median(values):6.2f} s  (min {min(values):.2f}, max {max(values):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
