"""Benchmark of the gate's sweep outside the targets: prints figures, asserts nothing.

    python benchmarks/discover.py                  # 1,000,000 archive rows, embedded PostgreSQL
    python benchmarks/discover.py --rows 200000
    python benchmarks/discover.py --database-url postgresql://postgres@127.0.0.1:5432/test

Creates ``bench_discover.archive`` (id, a text column, a jsonb document, a bytea column and an integer),
one row in 100 with an FPC1 value under key k1 in the text column and one in 1000 inside the document,
plus a small configured target; ANALYZEs, then times the full ``sweep_database`` (what every gate reads,
in one REPEATABLE READ snapshot as the gate reads it): the pattern scan of text/jsonb/bytea AND every
candidate value tried with the keys (nothing sampled: all N bytea values are 64 bytes, each one a
candidate, each tried). Timed with one key (``gate --retire KEY``) and with both keys (the run's gate,
``inventory --discover``), and the trial alone apart. The values are made in SQL (they need not decrypt:
the pattern counts key ids, the trial tries keys). Test keys only, thrown away.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pinrotate_core.config import settings_from_mapping
from pinrotate_core.db import embedded_server
from pinrotate_core.gate.discover import Discovery, sweep_database
from pinrotate_core.gate.sweep_plan import plan_sweep
from pinrotate_core.gate.sweep_trial import TrialKeys, trial_finds
from pinrotate_core.keyring import Key, Keyring

SCHEMA = "bench_discover"


def seed(conn: psycopg.Connection[tuple[object, ...]], rows: int) -> None:
    conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    conn.execute(f"CREATE SCHEMA {SCHEMA}")
    conn.execute(f"CREATE TABLE {SCHEMA}.secrets (id bigint PRIMARY KEY, secret text)")
    conn.execute(f"INSERT INTO {SCHEMA}.secrets SELECT i, 'FPC1:SM4:k2:' || encode(sha256(i::text::bytea), "
                 "'base64') FROM generate_series(1, 1000) i")
    conn.execute(f"""
        CREATE TABLE {SCHEMA}.archive (id bigint, note text, doc jsonb, blob bytea, n integer)""")
    conn.execute(f"""
        INSERT INTO {SCHEMA}.archive
        SELECT i,
               CASE WHEN i % 100 = 0
                    THEN 'FPC1:SM4:k1:' || encode(sha256(i::text::bytea) || sha256((i + 1)::text::bytea), 'base64')
                    ELSE 'customer note number ' || i END,
               jsonb_build_object('kind', 'order', 'n', i, 'secret',
                                  CASE WHEN i % 1000 = 0 THEN 'FPC1:SM4:k1:' || md5(i::text) ELSE md5(i::text) END),
               sha256(i::text::bytea) || sha256((i * 7)::text::bytea),
               i
          FROM generate_series(1, {rows}) i""")
    conn.execute(f"ANALYZE {SCHEMA}.archive")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--database-url", help="an existing server's database (default: embedded, temporary)")
    args = ap.parse_args()
    sandbox = Path(tempfile.mkdtemp(prefix="pinrotate-bench-"))
    server = None
    try:
        if args.database_url:
            url = args.database_url
        else:
            server = embedded_server(sandbox / "pgdata", cleanup_mode="delete")
            url = server.get_uri()
        keys = {k: Key(k, secrets.token_bytes(16)) for k in ("k1", "k2")}
        keyring = Keyring(current="k2", keys=keys, source="benchmark TEST keys")
        settings = settings_from_mapping({
            "database": {"url": url},
            "targets": [{"name": "S", "table": f"{SCHEMA}.secrets", "columns": ["secret"], "format": "fpc1"}],
            # Only this benchmark's schema: a shared test server may hold other helpers' databases' tables.
            "gate": {"discover_skip": ["public.*"]},
        }, env={})
        with psycopg.connect(url, autocommit=True) as conn:
            started = time.monotonic()
            seed(conn, args.rows)
            print(f"seeded {args.rows:,} archive rows in {time.monotonic() - started:.1f} s "
                  f"(PostgreSQL {conn.info.server_version // 10000})")
            row = conn.execute(f"SELECT pg_total_relation_size('{SCHEMA}.archive')").fetchone()
            size_mb = int(row[0]) / 2**20 if row else 0.0
            print(f"archive table: {size_mb:.0f} MiB, 3 swept columns (note text, doc jsonb, blob bytea; n integer "
                  "is not read)")
            one_key: list[float] = []
            both_keys: list[float] = []
            trial: list[float] = []
            found = Discovery(server_side=False)
            for _ in range(args.repeat):
                for key_ids, into in ((["k1"], one_key), (None, both_keys)):
                    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                    found = sweep_database(conn, settings, keyring, key_ids)
                    conn.execute("ROLLBACK")
                    into.append(found.seconds)
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                plan = plan_sweep(conn, settings)
                keys = TrialKeys(keyring, ["k1"])
                started = time.monotonic()
                for table in plan.tables:
                    trial_finds(conn, table, keys)
                trial.append(time.monotonic() - started)
                conn.execute("ROLLBACK")
            by_column = {f.column: f.by_key for f in found.finds}
            print(f"finds: {by_column}")
            for label, runs in (("full sweep, 1 key (gate --retire KEY)", one_key),
                                ("full sweep, 2 keys (run's gate, inventory --discover)", both_keys)):
                med = statistics.median(runs)
                print(f"{label}: median {med:.2f} s over {args.repeat} runs ({args.rows / med:,.0f} rows/s); runs: "
                      + ", ".join(f"{s:.2f}" for s in runs))
            print(f"of which the trial of every candidate value ({args.rows:,} bytea values, 1 key): "
                  f"median {statistics.median(trial):.2f} s")
            conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")
    finally:
        if server is not None:
            server.cleanup()
        shutil.rmtree(sandbox, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
