"""``benchmarks/drain.py --database-url mysql://...``: pinrotate's MySQL / MariaDB run (with crypto)
beside an in-database ``UPDATE`` of the same rows, in the same run.

A database of its own on the server (dropped at the end), ``--rows`` Pin-profile-like persons: two
base64 AES-GCM cipher columns under key 1, a key version and an ``updated_at ... ON UPDATE
CURRENT_TIMESTAMP``; a ``file`` keyring with key 2 current. Shapes, each over every row:

- ``update``: ``UPDATE persons SET key_version = 2, c1 = REVERSE(c1), c2 = REVERSE(c2)`` (no client,
  no crypto: the floor of writing the same bytes);
- ``pinrotate``: the run's drain steps (``rotation.resolve_all`` and ``rotation.drain`` per target,
  which ask ``pinrotate_core.commands.mysql.run``), as the flow's drain task runs them (keyset batches of
  ``--batch-size``, decrypt + encrypt + verify each value, the CAS write of ``engines/mysql/guard.py``,
  read back).

Rows/s, this process's CPU per row and the server's (``/proc/<mariadbd pid>`` when local; other
sessions' work on a shared server counts too); with ``--statements``, each kind of statement's
share of the run (``mysql_floor.StatementCosts``: exact on a server of one's own). Prints figures,
asserts nothing.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import secrets
import tempfile
import time
from pathlib import Path

import pymysql
import tomli_w
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from mysql_floor import StatementCosts, server_cpu, server_pid  # type: ignore[import-not-found]
from sqlalchemy.engine import make_url

from pinrotate_core import rotation
from pinrotate_core.config import Settings, load_settings
from pinrotate_core.engines.mysql.connect import make_engine, raw_connection
from pinrotate_core.errors import DatabaseError

TABLE = ("CREATE TABLE persons (id bigint NOT NULL PRIMARY KEY, c1 text NOT NULL, c2 text NULL, key_version int NOT NULL,"
         " updated_at datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6))"
         " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4")


def _text(aead: AESGCM, plain: bytes) -> str:
    nonce = secrets.token_bytes(12)
    return base64.b64encode(nonce + aead.encrypt(nonce, plain, None)).decode("ascii")


def _drain(settings: Settings) -> int:
    """Every target drained as the flow's drain task drains it (no gate, no verify): rows moved."""
    ctx = rotation.open_run(settings, create_keyring=False)
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        return sum(rotation.drain(ctx, t.name).reencrypted for t in ctx.targets)
    finally:
        ctx.close()


def main_mysql(args: argparse.Namespace) -> int:
    url = make_url(args.database_url)
    database = f"pinrotate_bench_{secrets.token_hex(4)}"
    sandbox = Path(tempfile.mkdtemp(prefix="pinrotate-bench-mysql-"))
    sandbox.chmod(0o700)
    keys = {1: secrets.token_bytes(32), 2: secrets.token_bytes(32)}
    keys_file = sandbox / "keys.toml"
    keys_file.write_text(tomli_w.dumps({"current": 2, "keys": {str(k): base64.b64encode(v).decode() for k, v in keys.items()}}))
    keys_file.chmod(0o600)
    db_url = url.set(database=database).render_as_string(hide_password=False)
    config = sandbox / "pinrotate.toml"
    config.write_text(tomli_w.dumps({
        "database": {"url": db_url}, "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": args.batch_size, "inter_batch_delay": 0, "max_run_duration": 86400},
        "targets": [{"name": "Person", "table": "persons", "id": "id", "key_version": "key_version",
                     "columns": ["c1", "c2"], "format": "aesgcm"}]}))
    admin = make_engine(url.set(database="mysql").render_as_string(hide_password=False))
    try:
        with raw_connection(admin) as conn, conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {database}")
            cpu = server_cpu(conn)
            pid = server_pid(conn) if getattr(args, "statements", False) else None
        costs = StatementCosts(pid) if pid is not None else None
        engine = make_engine(db_url)
        old = AESGCM(keys[1])
        try:
            with raw_connection(engine) as conn, conn.cursor() as cur:
                cur.execute(TABLE)

                def fill() -> None:
                    cur.execute("TRUNCATE persons")
                    for lo in range(0, args.rows, 2000):
                        rows = [(i, _text(old, f"first {i}".encode()), _text(old, f"last {i}".encode()), 1)
                                for i in range(lo + 1, min(lo + 2000, args.rows) + 1)]
                        cur.executemany("INSERT INTO persons (id, c1, c2, key_version) VALUES (%s, %s, %s, %s)", rows)

                print(f"{args.rows} rows on {database} (batch size {args.batch_size}); server CPU "
                      f"{'read from /proc' if cpu() is not None else 'not readable (remote server)'}")
                for _ in range(max(args.repeat, 1)):
                    fill()
                    s0, c0, t0 = cpu(), time.process_time(), time.perf_counter()
                    cur.execute("UPDATE persons SET key_version = 2, c1 = REVERSE(c1), c2 = REVERSE(c2)")
                    _report("in-database UPDATE", args.rows, time.perf_counter() - t0, time.process_time() - c0, s0, cpu())
                    fill()
                    settings = load_settings(str(config))
                    s0, c0, t0 = cpu(), time.process_time(), time.perf_counter()
                    if costs is not None:
                        costs.active = True
                    moved = _drain(settings)
                    _report(f"pinrotate run ({moved} rows)", moved, time.perf_counter() - t0, time.process_time() - c0,
                            s0, cpu())
                    if costs is not None:
                        costs.active = False
                        costs.print(moved)
        finally:
            engine.dispose()
            if costs is not None:
                costs.restore()
    finally:
        with contextlib.suppress(pymysql.err.MySQLError, DatabaseError), raw_connection(admin) as conn, conn.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {database}")
        admin.dispose()
        for f in sandbox.iterdir():
            f.unlink()
        sandbox.rmdir()
    return 0


def _report(shape: str, rows: int, secs: float, client: float, s0: float | None, s1: float | None) -> None:
    server = "" if s0 is None or s1 is None else f", server {(s1 - s0) / max(rows, 1) * 1e6:.1f} µs CPU/row"
    print(f"{shape:32s} {rows / secs:12,.0f} rows/s  client {client / max(rows, 1) * 1e6:.1f} µs CPU/row{server}")
