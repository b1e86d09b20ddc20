"""Benchmark of the drain: prints figures, asserts nothing (speed is measured here, never in tests).

    python benchmarks/drain.py                    # 200,000 person rows, embedded PostgreSQL
    python benchmarks/drain.py --rows 1000000     # peak memory must not grow with the table
    python benchmarks/drain.py --workers 2        # max_degree_of_parallelism
    python benchmarks/drain.py --transit          # also the Vault Transit rewrap drain (local OpenBao)
    python benchmarks/drain.py --dask 2           # also: shards on a local Dask cluster of 2 worker processes

Seeds the Pin profile preset under key 1 (test keys, thrown away), promotes key 2, drains the
Person target (4 cipher columns) and prints rows/s and peak RSS during the drain, with, in the same
run, the ratio against (a) an in-database ``UPDATE ... SET key_version = key_version + 1`` over the
same rows (the floor of writing the rows at all) and (b) a row-at-a-time loop on a sample.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows import presets
from pinrotate_core.config import settings_from_mapping
from pinrotate_core.db import embedded_server, make_engine, raw_connection
from pinrotate_core.drain import DrainOptions, drain_target
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.schemes import build_scheme
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.targets import resolve_target

PERSON = {"name": "Person", "table": "profile.persons", "key_version": "key_version",
          "columns": ["first_name_cipher", "last_name_cipher", "middle_name_cipher", "birth_date_cipher"]}


class RssSampler:
    """Peak resident memory of this process while a block runs (sampled from /proc every 20 ms)."""

    def __init__(self) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss_kb() -> int:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_kb = max(self.peak_kb, self.rss_kb())

    def __enter__(self) -> RssSampler:
        self.peak_kb = self.rss_kb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _parallel_run(url: str, keys_path: str, batch_size: int, out: multiprocessing.Queue[int]) -> None:
    """One of several independent runs on the same target, as parallel deployments would be."""
    ring = FileKeyProvider(keys_path).load_keyring()
    settings = settings_from_mapping({"database": {"url": url}, "targets": [PERSON]})
    engine = make_engine(url, pool_size=5)
    with raw_connection(engine) as conn:
        target = resolve_target(conn, settings.targets[0])
    out.put(drain_target(engine, build_scheme(target, ring, settings.keys), DrainOptions(batch_size=batch_size)).reencrypted)
    engine.dispose()


def parallel_runs(url: str, keys_path: str, batch_size: int, processes: int) -> tuple[int, float]:
    """``processes`` runs at once (separate processes, SKIP LOCKED keeps them apart); (rows, seconds)."""
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[int] = ctx.Queue()
    procs = [ctx.Process(target=_parallel_run, args=(url, keys_path, batch_size, out)) for _ in range(processes)]
    started = time.perf_counter()
    for p in procs:
        p.start()
    moved = sum(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return moved, time.perf_counter() - started


def _dask_shard(raw: dict[str, Any], id_range: tuple[Any, Any]) -> tuple[int, int]:
    """One shard in a Dask worker process, as the flow's drain task runs it; (rows moved, peak RSS in KiB)."""
    from pinrotate_core import rotation

    ctx = rotation.open_run(settings_from_mapping(raw), run_id="benchmark")
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        moved = rotation.drain(ctx, "Person", workers=1, id_range=id_range).reencrypted
    finally:
        ctx.close()
    return moved, _peak_rss_kb()


def dask_run(raw: dict[str, Any], processes: int) -> tuple[int, float, dict[str, int]]:
    """Shards (4 per process) on a local Dask cluster of ``processes`` one-thread worker processes,
    the cluster started before the clock; (rows, seconds, peak RSS KiB per worker)."""
    import logging

    import dask
    from distributed import Client, LocalCluster

    from flows.runtime import WORKER_MALLOC_TRIM_THRESHOLD

    from pinrotate_core import rotation

    logging.getLogger("distributed").setLevel(logging.WARNING)
    # As the flow's local cluster does (flows/runtime.py): keep glibc from trimming after every batch.
    dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": WORKER_MALLOC_TRIM_THRESHOLD})
    with LocalCluster(n_workers=processes, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(processes)
        # A cluster's workers are long-lived: they pay pinrotate's imports once, not per run.
        client.run(_warm_worker)
        started = time.perf_counter()
        ctx = rotation.open_run(settings_from_mapping(raw), run_id="benchmark")
        try:
            rotation.read_current_key(ctx, announce=False)
            rotation.resolve_all(ctx)
            shards = [r for r, _ in rotation.plan_shards(ctx, "Person", 4 * processes)]
        finally:
            ctx.close()
        futures = [client.submit(_dask_shard, raw, r, pure=False) for r in shards]
        moved = sum(future.result()[0] for future in futures)
        secs = time.perf_counter() - started
        peaks = client.run(_peak_rss_kb)  # each worker process's peak since it started
    return moved, secs, {str(k): int(v) for k, v in peaks.items()}


def _warm_worker() -> None:
    import pinrotate_core.rotation  # noqa: F401  (the imports a drain task needs, once per worker)


def _peak_rss_kb() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def row_at_a_time(url: str, ciphers: AesGcmCipherSet, sample: int, new_version: int) -> float:
    """The naive job: one row per transaction (SELECT FOR UPDATE, UPDATE, COMMIT); rows/s on a sample."""
    started = time.perf_counter()
    done = 0
    with psycopg.connect(url) as conn:
        while done < sample:
            with conn.transaction():
                row = conn.execute(
                    "SELECT id, key_version, first_name_cipher, last_name_cipher, middle_name_cipher, birth_date_cipher"
                    " FROM profile.persons WHERE key_version < %s ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED",
                    (new_version,)).fetchone()
                if row is None:
                    break
                new = [None if v is None else ciphers.encrypt_current(ciphers.decrypt(str(row[1]), v)) for v in row[2:]]
                conn.execute("UPDATE profile.persons SET first_name_cipher = %s, last_name_cipher = %s, "
                             "middle_name_cipher = %s, birth_date_cipher = %s, key_version = %s WHERE id = %s",
                             (*new, new_version, row[0]))
            done += 1
    return done / (time.perf_counter() - started)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000, help="person rows (default 200000)")
    ap.add_argument("--batch-size", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=1, help="max_degree_of_parallelism (default 1)")
    ap.add_argument("--sample", type=int, default=2000, help="rows for the row-at-a-time comparison")
    ap.add_argument("--database-url", help="an existing server's database (default: embedded, temporary)")
    ap.add_argument("--transit", action="store_true", help="also benchmark the Vault Transit rewrap drain")
    ap.add_argument("--dask", type=int, default=0, metavar="N",
                    help="also: shards of the same rows on a local Dask cluster of N worker processes")
    ap.add_argument("--processes", type=int, default=0,
                    help="also: this many independent runs at once (separate processes) on the same rows")
    args = ap.parse_args()

    sandbox = Path(tempfile.mkdtemp(prefix="pinrotate-bench-"))
    cleanups: list[Callable[[], None]] = []
    try:
        if args.database_url:
            url = args.database_url
        else:
            server = embedded_server(sandbox / "pgdata", cleanup_mode="delete")
            cleanups.append(server.cleanup)
            url = server.get_uri()
        provider = FileKeyProvider(sandbox / "keys.toml")
        ring = provider.load_keyring()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP SCHEMA IF EXISTS profile CASCADE")
            presets.apply_pin_profile_schema(conn)
            t0 = time.perf_counter()
            presets.seed_pin_profile(conn, ring, rows=args.rows, key_id="1", seed=1)
            seeded_s = time.perf_counter() - t0
            conn.execute("VACUUM ANALYZE profile.persons")
        provider.add_key()
        provider.promote("2")
        ring2 = provider.load_keyring()
        print(f"seeded {args.rows:,} persons in {seeded_s:.1f} s; PostgreSQL "
              f"{psycopg.connect(url).info.server_version}; python {sys.version.split()[0]}; {os.cpu_count()} cores")

        settings = settings_from_mapping({"database": {"url": url}, "targets": [PERSON]})
        engine = make_engine(url, pool_size=3 * args.workers + 2)
        with raw_connection(engine) as conn:
            target = resolve_target(conn, settings.targets[0])
        options = DrainOptions(batch_size=args.batch_size, workers=args.workers)
        with RssSampler() as rss:
            t0 = time.perf_counter()
            result = drain_target(engine, build_scheme(target, ring2, settings.keys), options)
            drain_s = time.perf_counter() - t0
        assert result.backlog_remaining == 0 and not result.failed, result
        drain_rate = result.reencrypted / drain_s
        print(f"drain: {result.reencrypted:,} rows in {drain_s:.2f} s = {drain_rate:,.0f} rows/s "
              f"(batch {args.batch_size}, workers {args.workers}, {result.batches} batches)")
        print(f"peak RSS during the drain: {rss.peak_kb / 1024:.1f} MiB")

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM profile.persons")
            t0 = time.perf_counter()
            conn.execute("UPDATE profile.persons SET key_version = key_version + 1")  # 2 -> 3, same rows
            update_s = time.perf_counter() - t0
            conn.execute("UPDATE profile.persons SET key_version = 2")
            conn.execute("VACUUM profile.persons")
        update_rate = args.rows / update_s
        def compact() -> None:
            # Every comparison starts from the same physical table the single-process drain met:
            # the drain and the UPDATEs above left it bloated, which would slow the later figures.
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("VACUUM FULL ANALYZE profile.persons")

        if args.processes:
            compact()
            provider.add_key()
            provider.promote("3")  # a fresh backlog: every row moves 2 -> 3 again
            moved, secs = parallel_runs(url, str(sandbox / "keys.toml"), args.batch_size, args.processes)
            print(f"{args.processes} runs in parallel (processes): {moved:,} rows in {secs:.2f} s = "
                  f"{moved / secs:,.0f} rows/s; vs one run = {moved / secs / drain_rate:.2f}x")
        if args.dask:
            compact()
            provider.add_key()
            provider.promote(provider.load_keyring().ids()[-1])  # a fresh backlog: every row moves again
            raw = {"database": {"url": url}, "keys": {"provider": "file", "file": str(sandbox / "keys.toml")},
                   "job": {"batch_size": args.batch_size, "inter_batch_delay": 0}, "targets": [PERSON]}
            moved, secs, peaks = dask_run(raw, args.dask)
            dask_rate = moved / secs
            print(f"dask, {args.dask} processes: {moved:,} rows in {secs:.2f} s = {dask_rate:,.0f} rows/s; "
                  f"vs one process = {dask_rate / drain_rate:.2f}x; dask / UPDATE = {dask_rate / update_rate:.2f}")
            print("peak RSS per Dask worker: " + ", ".join(f"{kb / 1024:.1f} MiB" for kb in peaks.values()))
        provider.add_key()  # a new key, current stays 2: the loop writes it by hand
        ring_now = FileKeyProvider(sandbox / "keys.toml").load_keyring()
        newest = ring_now.ids()[-1]
        loop_ciphers = AesGcmCipherSet(type(ring_now)(current=newest, keys=ring_now.keys, source="bench"))
        loop_rate = row_at_a_time(url, loop_ciphers, min(args.sample, args.rows), int(newest))
        engine.dispose()

        print(f"in-database UPDATE of the same rows: {update_rate:,.0f} rows/s; drain / UPDATE = {drain_rate / update_rate:.2f}")
        print(f"row-at-a-time loop (sample {min(args.sample, args.rows):,}): {loop_rate:,.0f} rows/s; "
              f"drain / loop = {drain_rate / loop_rate:.1f}x")
        if args.transit:
            from benchmarks.drain_transit import bench_transit, print_figures

            best = print_figures(bench_transit(min(args.rows, 50_000), [200, 490, 1000, 2000]))
            print(f"transit: best batch size {best['batch_size']} = {best['rows_per_s']:,} rows/s; "
                  f"transit / local-key drain = {best['rows_per_s'] / drain_rate:.2f}")
        return 0
    finally:
        for cleanup in cleanups:  # stop the server before its folder goes
            cleanup()
        shutil.rmtree(sandbox, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
