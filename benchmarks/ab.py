"""Paired A/B of two code trees of the drain: what a change bought, on one server, in one run.

    git worktree add /tmp/before <commit>                     # the tree before the change
    python benchmarks/ab.py /tmp/before . --rows 200000 --rounds 4

Prints figures, asserts nothing. One embedded PostgreSQL is seeded once (the Pin profile's Person
target, every row on key 1, key 2 current); each round restores the seeded table and drains it once
with each tree in turn, in a fresh process that imports that tree (round 0 warms up, untimed), then
times the in-database ``UPDATE`` of the same rows. Per drain: PostgreSQL server CPU per row (exact,
from ``/proc``, as ``drain.py`` counts it), the drain process's own CPU per row, rows/s and WAL per
row. Rounds alternate, so a slower or faster minute of a shared machine taxes both trees alike:
compare the medians of one run, never figures across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import drain as bench
from pinrotate_core.providers.file import FileKeyProvider

# The drain, in a process of its own that imports pinrotate from the tree given (argv[1]).
CHILD = r'''
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks.drain import PERSON, build_scheme
from pinrotate_core.config import settings_from_mapping
from pinrotate_core.db import make_engine, raw_connection
from pinrotate_core.drain import DrainOptions, drain_target
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.targets import resolve_target
url, keys, batch = sys.argv[2], sys.argv[3], int(sys.argv[4])
settings = settings_from_mapping({"database": {"url": url}, "targets": [PERSON]})
engine = make_engine(url, pool_size=5)
with raw_connection(engine) as conn:
    target = resolve_target(conn, settings.targets[0])
scheme = build_scheme(target, FileKeyProvider(keys).load_keyring(), settings.keys)
print("ready", flush=True)
sys.stdin.readline()
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
result = drain_target(engine, scheme, DrainOptions(batch_size=batch))
secs, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
assert result.backlog_remaining == 0 and not result.failed, result
own = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
print(json.dumps({"moved": result.reencrypted, "secs": secs, "own": own}), flush=True)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs=2, help="two checkouts of this repository: before, after")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=2000)
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees]
    for tree in trees:
        if not (Path(tree) / "pinrotate_core").is_dir():
            ap.error(f"{tree}: not a checkout of pinrotate (no pinrotate_core/)")
    with bench.counted_server("pinrotate-ab-") as (sandbox, url):
        provider = FileKeyProvider(sandbox / "keys.toml", create=True)  # test keys, thrown away
        with psycopg.connect(url, autocommit=True) as conn:
            bench.seed_persons(conn, provider.load_keyring(), args.rows)
        provider.add_key()
        provider.promote("2")

        def restore() -> None:
            bench.restore_persons(url)

        def drain(tree: str) -> tuple[float, float, float, float]:
            restore()
            child = subprocess.Popen([sys.executable, "-c", CHILD, tree, url, str(sandbox / "keys.toml"),
                                      str(args.batch_size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert child.stdin is not None and child.stdout is not None
            if child.stdout.readline().strip() != "ready":
                raise SystemExit(f"{tree}: the drain process did not start")
            start, server_cpu = bench.wal_lsn(url), bench.server_cpu_snapshot()
            child.stdin.write("\n")
            child.stdin.flush()
            out: dict[str, Any] = json.loads(child.stdout.readline())
            child.wait()
            server_s = bench.server_cpu_since(server_cpu)
            wal = bench.wal_bytes_since(url, start)
            return server_s / args.rows * 1e6, out["own"] / args.rows * 1e6, args.rows / out["secs"], wal / args.rows

        def update() -> float:
            restore()
            with psycopg.connect(url, autocommit=True) as conn:
                server_cpu = bench.server_cpu_snapshot()
                conn.execute("UPDATE profile.persons SET key_version = key_version + 1")
                return float(bench.server_cpu_since(server_cpu) / args.rows * 1e6)

        print(f"{args.rows:,} persons; batch {args.batch_size}; before {trees[0]}, after {trees[1]}", flush=True)
        figures: dict[str, list[tuple[float, float, float, float]]] = {"before": [], "after": []}
        updates: list[float] = []
        for round_no in range(args.rounds + 1):
            for name, tree in zip(("before", "after"), trees):
                figure = drain(tree)
                if round_no:  # round 0 warms the server up
                    figures[name].append(figure)
                    print(f"round {round_no} {name:6}: PostgreSQL {figure[0]:5.2f} us/row, drain process "
                          f"{figure[1]:5.2f} us/row, {figure[2]:8,.0f} rows/s, WAL {figure[3]:4.0f} B/row", flush=True)
            if round_no:
                updates.append(update())
                print(f"round {round_no} UPDATE: PostgreSQL {updates[-1]:5.2f} us/row", flush=True)
        base = statistics.median(updates)
        for name, f in figures.items():
            server_us = statistics.median(x[0] for x in f)
            print(f"median {name:6}: PostgreSQL {server_us:5.2f} us/row = {server_us / base:.2f}x the UPDATE ({base:.2f}); "
                  f"drain process {statistics.median(x[1] for x in f):5.2f} us/row; "
                  f"{statistics.median(x[2] for x in f):,.0f} rows/s; WAL {statistics.median(x[3] for x in f):.0f} B/row")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
