"""What a drain costs the application: a writer's single-row update latency beside the drain.

    python benchmarks/writer_latency.py                 # 100,000 person rows, embedded PostgreSQL
    python benchmarks/writer_latency.py --rows 300000

Prints, in one run, an application writer's latency (one single-row UPDATE of a random person every
10 ms, in its own session; p50 / p99 / max) (a) alone, (b) beside the drain at full speed (fixed
batch, no pause, no throttle) and (c) beside the drain with the adaptive defaults (batch_time_target,
throttle on: lock-waiter back-off, operator switch; inter_batch_delay 0), with the drain's rows/s in
(b) and (c). Each drain moves every row to a new key (key 2, then key 3). Each drain is compared
with a writer-alone window measured just before it, so that a shared machine's changing load
counts less. Prints figures, asserts nothing.
Target (issue 12): (c) adds < 10 ms to the writer's p99 and keeps >= 70% of (b)'s rows/s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pinrotate_core.config import DEFAULT_BATCH_TIME_TARGET, settings_from_mapping
from pinrotate_core.db import embedded_server, make_engine, raw_connection
from pinrotate_core.drain import DrainOptions, DrainResult, drain_target
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.samples import pin_profile as presets
from pinrotate_core.schemes.registry import build_scheme
from pinrotate_core.targets import resolve_target
from pinrotate_core.throttle import Throttle

PERSON = {"name": "Person", "table": "profile.persons", "key_version": "key_version",
          "columns": ["first_name_cipher", "last_name_cipher", "middle_name_cipher", "birth_date_cipher"]}
WRITER_PERIOD_S = 0.010


def _write_every_10_ms(url: str, ids: list[Any], seed: int, stop: Any, out: Any) -> None:
    """The application (own process: the drain's GIL must not inflate its latencies)."""
    rng = random.Random(seed)
    latencies: list[float] = []
    with psycopg.connect(url, autocommit=True, application_name="app-writer") as conn:
        next_at = time.perf_counter()
        while not stop.is_set():
            row_id = rng.choice(ids)
            t0 = time.perf_counter()
            conn.execute("UPDATE profile.persons SET version = version + 1 WHERE id = %s", (row_id,))
            latencies.append((time.perf_counter() - t0) * 1000)
            next_at += WRITER_PERIOD_S
            pause = next_at - time.perf_counter()
            if pause > 0:
                stop.wait(pause)
            else:
                next_at = time.perf_counter()  # fell behind (a long wait): no burst to catch up
    out.put(latencies)


class Writer:
    """One application session: a single-row UPDATE every 10 ms, latencies kept in milliseconds."""

    def __init__(self, url: str, ids: list[Any], seed: int = 7) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._out: Any = ctx.Queue()
        self._proc = ctx.Process(target=_write_every_10_ms, args=(url, ids, seed, self._stop, self._out))
        self.latencies_ms: list[float] = []

    def __enter__(self) -> Writer:
        self._proc.start()
        time.sleep(1.0)  # let it connect and settle before the measured work starts
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.latencies_ms = self._out.get(timeout=120)
        self._proc.join()

    def figures(self) -> str:
        xs = sorted(self.latencies_ms)
        if not xs:
            return "no updates"
        p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
        return (f"p50 {statistics.median(xs):6.2f} ms  p99 {p99:7.2f} ms  max {xs[-1]:8.2f} ms  "
                f"({len(xs):,} updates)")

    def p99(self) -> float:
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else 0.0


def run_drain(url: str, provider: FileKeyProvider, options: Callable[[Any], DrainOptions],
              batch_time_target: float = DEFAULT_BATCH_TIME_TARGET) -> tuple[DrainResult, float]:
    """Make a new key current and drain every person row to it; (result, seconds)."""
    new = provider.add_key()
    provider.promote(new)
    ring = provider.load_keyring()
    settings = settings_from_mapping({"database": {"url": url}, "targets": [PERSON],
                                      "job": {"batch_time_target": batch_time_target, "inter_batch_delay": 0}},
                                     env={})
    engine = make_engine(url, pool_size=6)
    try:
        with raw_connection(engine) as conn:
            target = resolve_target(conn, settings.targets[0])
        scheme = build_scheme(target, ring, settings.keys)
        opts = options((engine, settings))
        t0 = time.perf_counter()
        result = drain_target(engine, scheme, opts)
        seconds = time.perf_counter() - t0
        if opts.throttle is not None:
            print(f"    throttle: last batch size {opts.throttle.batch_size}, waited "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in opts.throttle.waited.items()))
            opts.throttle.close()
    finally:
        engine.dispose()
    assert result.backlog_remaining == 0 and not result.failed, result
    return result, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000, help="person rows (default 100000)")
    ap.add_argument("--batch-size", type=int, default=200, help="full-speed batch size (default 200, as job.batch_size)")
    ap.add_argument("--alone", type=float, default=5.0, help="seconds of the writer alone (default 5)")
    ap.add_argument("--targets", default=str(DEFAULT_BATCH_TIME_TARGET),
                    help="batch_time_target values for (c), comma-separated (default: the default target)")
    args = ap.parse_args()

    sandbox = Path(tempfile.mkdtemp(prefix="pinrotate-bench-"))
    cleanups: list[Callable[[], None]] = []
    try:
        server = embedded_server(sandbox / "pgdata", cleanup_mode="delete")
        cleanups.append(server.cleanup)
        url = server.get_uri()
        provider = FileKeyProvider(sandbox / "keys.toml", create=True)
        ring = provider.load_keyring()
        with psycopg.connect(url, autocommit=True) as conn:
            presets.apply_pin_profile_schema(conn)
            presets.seed_pin_profile(conn, ring, rows=args.rows, key_id="1", seed=1)
            conn.execute("VACUUM ANALYZE profile.persons")
            ids = [r[0] for r in conn.execute("SELECT id FROM profile.persons").fetchall()]
        print(f"{args.rows:,} persons; PostgreSQL {psycopg.connect(url).info.server_version}; "
              f"python {sys.version.split()[0]}; {os.cpu_count()} cores (shared: figures are noisy)")

        def writer_alone(seed: int) -> Writer:
            with Writer(url, ids, seed=seed) as alone:
                time.sleep(args.alone)
            print(f"writer alone:                  {alone.figures()}")
            return alone

        alone = writer_alone(6)
        with Writer(url, ids, seed=8) as full:
            result, secs = run_drain(url, provider, lambda _: DrainOptions(batch_size=args.batch_size))
        full_rate = result.reencrypted / secs
        print(f"beside the drain, full speed:  {full.figures()}   drain {full_rate:,.0f} rows/s "
              f"(batch {args.batch_size}, {result.batches} batches)")

        def adaptive(es: Any) -> DrainOptions:
            engine, settings = es
            return DrainOptions(batch_size=settings.job.batch_size, throttle=Throttle.from_settings(engine, settings))

        print(f"full speed vs alone: p99 +{full.p99() - alone.p99():.2f} ms")
        for i, target in enumerate(float(t) for t in args.targets.split(",")):
            alone = writer_alone(20 + i)
            with Writer(url, ids, seed=9 + i) as tuned:
                result, secs = run_drain(url, provider, adaptive, target)
            tuned_rate = result.reencrypted / secs
            print(f"beside the drain, adaptive (batch_time_target {target:g} s): {tuned.figures()}   "
                  f"drain {tuned_rate:,.0f} rows/s ({result.batches} batches)")
            print(f"    vs alone: p99 +{tuned.p99() - alone.p99():.2f} ms (target < 10 ms); "
                  f"throughput {tuned_rate / full_rate:.0%} of full speed (target >= 70%)")
        return 0
    finally:
        for cleanup in reversed(cleanups):
            cleanup()
        shutil.rmtree(sandbox, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
