"""Benchmark of the drain: prints figures, asserts nothing (speed is measured here, never in tests).

    python benchmarks/drain.py                    # 200,000 person rows, embedded PostgreSQL
    python benchmarks/drain.py --rows 1000000     # peak memory must not grow with the table
    python benchmarks/drain.py --workers 2        # max_degree_of_parallelism
    python benchmarks/drain.py --transit          # also the Vault Transit rewrap drain (local OpenBao)
    python benchmarks/drain.py --dask 2           # also: shards on a local Dask cluster of 2 worker processes
    python benchmarks/drain.py --rows 20000 --trace   # also: the same drain traced (OTLP to a local collector)

Seeds the Pin profile preset under key 1 (test keys, thrown away), promotes a new key, drains the
Person target (4 cipher columns) and prints rows/s and peak RSS during the drain, with, in the same
run, the ratio against (a) an in-database ``UPDATE ... SET key_version = key_version + 1`` over the
same rows (the floor of writing the rows at all) and (b) a row-at-a-time loop on a sample.

Every timed figure starts from the same table: the seeded rows, restored from a copy taken after
seeding (same rows, same physical order, every row on key 1), vacuumed, and after a ``CHECKPOINT``,
so that none inherits another's dead rows, free space, physical order or pending WAL (and no
autovacuum of the table runs in the middle of one). One untimed
drain warms the server first (a new server creates its WAL segment files as it goes; a running one
recycles them). The figures are measured ``--repeat`` times in turns (drain, UPDATE, Dask, ...) and
the median of each is printed, with the ratios of every round: on a shared 2-core machine a single
round says little. With ``--dask`` it also prints Dask's fixed costs in seconds of worker time:
planning the shards, opening the run in each shard, and workers done while another still drains.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pinrotate_core import tracing
from pinrotate_core.config import settings_from_mapping
from pinrotate_core.db import embedded_server, make_engine, raw_connection
from pinrotate_core.drain import DrainOptions, drain_target, split_backlog
from pinrotate_core.keyring import Keyring
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.samples import pin_profile as presets
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.schemes.registry import build_scheme
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


def busy_cpu_seconds() -> float:
    """CPU seconds every process of this machine has used since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


SERVER_PID: int | None = None  # the PostgreSQL postmaster's pid, when the server runs on this machine


ServerCpu = tuple[float, dict[str, float]]  # (the postmaster's own and ended children's, live children's by pid)


def server_cpu_snapshot() -> ServerCpu:
    """CPU seconds of the PostgreSQL server's processes, to take a difference of with ``server_cpu_since``."""
    if SERVER_PID is None:
        return 0.0, {}
    tick = os.sysconf("SC_CLK_TCK")

    def stat(pid: str) -> list[str] | None:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
                return fh.read().rsplit(")", 1)[1].split()
        except OSError:  # ended between the listing and the read
            return None

    # Consistent only when no child was reaped while the children were read (its CPU would then be
    # in neither, or in both) and none is waiting to be (a zombie shows no CPU of its own, and its
    # life's CPU reaches the postmaster's cutime later): read again until so (bounded).
    deadline = time.monotonic() + 2.0
    while True:
        first = stat(str(SERVER_PID))
        if first is None:
            return 0.0, {}
        children: dict[str, float] = {}
        zombies = False
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                fields = stat(pid)
                if fields is not None and fields[1] == str(SERVER_PID):  # ppid
                    zombies = zombies or fields[0] in ("Z", "X")
                    children[pid] = (int(fields[11]) + int(fields[12])) / tick
        last = stat(str(SERVER_PID))
        own = sum(int(v) for v in first[11:15])  # utime, stime, cutime, cstime
        if last is not None and own == sum(int(v) for v in last[11:15]) and not zombies:
            return own / tick, children
        if time.monotonic() > deadline:
            return own / tick, children
        time.sleep(0.01)


def server_cpu_since(before: ServerCpu) -> float:
    """CPU seconds the server's processes spent since ``before``, exactly, whatever else the machine
    runs: live children's growth, new children's all, and ended children's (in the postmaster's
    cutime, which holds their whole life) less what they had already spent at ``before``. 0.0 when
    the server is not on this machine."""
    own_then, then = before
    own_now, now = server_cpu_snapshot()
    live = sum(cpu - then.get(pid, 0.0) for pid, cpu in now.items())
    ended_before = sum(cpu for pid, cpu in then.items() if pid not in now)
    return own_now - own_then - ended_before + live


def find_server_pid(url: str) -> int | None:
    """The postmaster's pid from its data directory's postmaster.pid, when that is readable here."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('data_directory')").fetchone()
    try:
        return int((Path(str(row[0])) / "postmaster.pid").read_text().split()[0]) if row else None
    except (OSError, ValueError, IndexError):
        return None


def own_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Cpu:
    """CPU seconds spent while a figure ran: the whole machine's, and the Python processes' doing it."""

    busy: float = 0.0
    python: float = 0.0
    driver: float | None = None  # of python: the process that planned the shards and hosts Dask's scheduler
    server: float = 0.0  # the PostgreSQL server's own processes (0.0: not on this machine)

    def per_row(self, rows: int) -> str:
        driver = "" if self.driver is None else f" of which the scheduler's process {self.driver / rows * 1e6:.1f}"
        server = ""
        if SERVER_PID is not None:
            rest = self.busy - self.python - self.server
            server = f", PostgreSQL server {self.server / rows * 1e6:.1f}, the rest {rest / rows * 1e6:.1f}"
        return (f"{self.busy / rows * 1e6:.1f} us CPU per row (Python {self.python / rows * 1e6:.1f}{driver}, "
                f"PostgreSQL and the rest {(self.busy - self.python) / rows * 1e6:.1f}{server})")


def _parallel_run(url: str, keys_path: str, batch_size: int, id_range: tuple[Any, Any], ready: Any,
                  out: multiprocessing.Queue[tuple[int, float]]) -> None:
    """One of several independent runs on the same target, as parallel deployments would be."""
    ring = FileKeyProvider(keys_path).load_keyring()
    settings = settings_from_mapping({"database": {"url": url}, "targets": [PERSON]})
    engine = make_engine(url, pool_size=5)
    with raw_connection(engine) as conn:
        target = resolve_target(conn, settings.targets[0])
    scheme = build_scheme(target, ring, settings.keys)
    ready.wait()  # every process loaded and connected: the clock starts now
    before = own_cpu_seconds()
    moved = drain_target(engine, scheme, DrainOptions(batch_size=batch_size, id_range=id_range)).reencrypted
    out.put((moved, own_cpu_seconds() - before))
    engine.dispose()


def parallel_runs(url: str, keys_path: str, batch_size: int,
                  ranges: list[tuple[Any, Any]]) -> tuple[int, float, Cpu]:
    """One plain process per id range at once (the Dask shards without Dask), started and connected
    before the clock; (rows, seconds, CPU)."""
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[tuple[int, float]] = ctx.Queue()
    ready = ctx.Barrier(len(ranges) + 1)
    procs = [ctx.Process(target=_parallel_run, args=(url, keys_path, batch_size, r, ready, out)) for r in ranges]
    for p in procs:
        p.start()
    ready.wait()
    busy, server = busy_cpu_seconds(), server_cpu_snapshot()
    started = time.perf_counter()
    results = [out.get(timeout=600) for _ in procs]
    secs = time.perf_counter() - started
    cpu = Cpu(busy_cpu_seconds() - busy, sum(c for _, c in results), server=server_cpu_since(server))
    for p in procs:
        p.join()
    return sum(m for m, _ in results), secs, cpu


@dataclass
class ShardTimes:
    """Where one shard's time went, in seconds since the run's clock started (one machine's clock)."""

    worker: int  # the worker process's pid
    started: float
    draining: float  # the run opened, the key read, the target resolved: the drain begins
    ended: float


def _dask_shard(raw: dict[str, Any], id_range: tuple[Any, Any], rows: int,
                clock: float) -> tuple[int, int, ShardTimes]:
    """One shard in a Dask worker process, as the flow's drain task runs it; (rows moved, peak RSS
    in KiB, its times against ``clock``, the run's ``time.time()`` at its start)."""
    from pinrotate_core import rotation

    started = time.time() - clock
    ctx = rotation.open_run(settings_from_mapping(raw), run_id="benchmark")
    try:
        rotation.read_current_key(ctx, announce=False)
        rotation.resolve_all(ctx)
        draining = time.time() - clock
        moved = rotation.drain(ctx, "Person", workers=1, id_range=id_range, planned_backlog=rows).reencrypted
    finally:
        ctx.close()
    return moved, _peak_rss_kb(), ShardTimes(os.getpid(), started, draining, time.time() - clock)


@dataclass
class DaskCosts:
    """Dask's fixed costs in one run, in seconds of worker time (processes x seconds)."""

    planning: float  # before the first shard could start: every worker waits
    setup: float  # opening the run in each shard, before its drain
    idle_at_end: float  # workers done while another still drains its last shard

    @classmethod
    def of(cls, times: list[ShardTimes], planned: float, processes: int, secs: float) -> DaskCosts:
        last: dict[int, float] = {}
        for t in times:
            last[t.worker] = max(last.get(t.worker, 0.0), t.ended)
        idle = sum(secs - end for end in last.values()) + secs * (processes - len(last))
        return cls(planned * processes, sum(t.draining - t.started for t in times), idle)


def dask_run(raw: dict[str, Any], processes: int) -> tuple[int, float, dict[str, int], Cpu, DaskCosts]:
    """Shards (4 per process) on a local Dask cluster of ``processes`` one-thread worker processes,
    the cluster started before the clock; (rows, seconds, peak RSS KiB per worker, CPU, fixed costs)."""
    import logging

    import dask
    from distributed import Client, LocalCluster

    from flows.runtime import LOCAL_WORKER_CONFIG
    from pinrotate_core import rotation

    logging.getLogger("distributed").setLevel(logging.WARNING)
    dask.config.set(LOCAL_WORKER_CONFIG)  # as the flow's local cluster (flows/runtime.py)
    with LocalCluster(n_workers=processes, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(processes)
        # A cluster's workers are long-lived: they pay pinrotate's imports once, not per run.
        client.run(_warm_worker)
        ctx = rotation.open_run(settings_from_mapping(raw), run_id="benchmark")
        try:
            rotation.read_current_key(ctx, announce=False)
            rotation.resolve_all(ctx)
            # The clock starts where the single-process figure's does (at the drain, the run opened),
            # and includes planning the shards.
            workers_before = sum(client.run(own_cpu_seconds).values())
            busy_before, own_before, server_before = busy_cpu_seconds(), own_cpu_seconds(), server_cpu_snapshot()
            started, clock = time.perf_counter(), time.time()
            shards = rotation.plan_shards(ctx, "Person", 4 * processes)
            planned = time.perf_counter() - started
        finally:
            ctx.close()
        futures = [client.submit(_dask_shard, raw, s.id_range, s.rows, clock, pure=False) for s in shards]
        results = [future.result() for future in futures]
        secs = time.perf_counter() - started
        driver = own_cpu_seconds() - own_before
        cpu = Cpu(busy_cpu_seconds() - busy_before, driver + sum(client.run(own_cpu_seconds).values()) - workers_before,
                  driver, server_cpu_since(server_before))
        peaks = client.run(_peak_rss_kb)  # each worker process's peak since it started
    costs = DaskCosts.of([t for _, _, t in results], planned, processes, secs)
    return sum(m for m, _, _ in results), secs, {str(k): int(v) for k, v in peaks.items()}, cpu, costs


@contextlib.contextmanager
def counted_server(prefix: str) -> Iterator[tuple[Path, str]]:
    """(sandbox, url) of an embedded PostgreSQL whose processes are read for exact CPU figures
    (``SERVER_PID``); stopped and removed after."""
    global SERVER_PID
    sandbox = Path(tempfile.mkdtemp(prefix=prefix))
    server = embedded_server(sandbox / "pgdata", cleanup_mode="delete")
    try:
        url = server.get_uri()
        SERVER_PID = find_server_pid(url)
        if SERVER_PID is None:
            raise SystemExit("the server's processes are not readable here: no exact CPU figure")
        yield sandbox, url
    finally:
        server.cleanup()
        shutil.rmtree(sandbox, ignore_errors=True)


def seed_persons(conn: psycopg.Connection[Any], ring: Keyring, rows: int) -> None:
    """The Pin profile with ``rows`` persons on key 1, and the copy every figure starts from."""
    presets.apply_pin_profile_schema(conn)
    presets.seed_pin_profile(conn, ring, rows=rows, key_id="1", seed=1)
    conn.execute("CREATE TABLE profile.persons_seeded AS TABLE profile.persons")
    # restore_persons() vacuums before every figure; an autovacuum waking in the middle of one
    # figure (every 60 s, once a fifth of the rows are dead) would tax that figure alone.
    conn.execute("ALTER TABLE profile.persons SET (autovacuum_enabled = off)")


def restore_persons(url: str) -> None:
    """Back to the seeded table (every row on key 1 again), vacuumed, after a checkpoint: no figure
    inherits another's dead rows, free space, physical order or pending WAL."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE profile.persons")
        conn.execute("INSERT INTO profile.persons SELECT * FROM profile.persons_seeded")
        conn.execute("VACUUM ANALYZE profile.persons")
        conn.execute("CHECKPOINT")


def wal_lsn(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def wal_bytes_since(url: str, start: str) -> int:
    """WAL bytes written since ``start`` (deterministic for the same statements: it holds on a noisy machine)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)", (start,)).fetchone()
    assert row is not None
    return int(row[0])


def bare_aead_per_row(url: str, old: bytes, new: bytes, rows: int) -> tuple[float, int]:
    """The least crypto a rotation must do, timed alone on the table's own values: per value decrypt under
    the old key, encrypt under the new one, and decrypt that again (verify-before-commit); CPU seconds of
    this process per row, and the values done. Values are read before the clock."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    with psycopg.connect(url) as conn:
        values = [bytes(v) for row in conn.execute(
            "SELECT first_name_cipher, last_name_cipher, middle_name_cipher, birth_date_cipher "
            "FROM profile.persons_seeded ORDER BY id LIMIT %s", (rows,)) for v in row if v is not None]
    before, after = AESGCM(old), AESGCM(new)
    t0 = time.process_time()
    for value in values:
        plain = before.decrypt(value[:12], value[12:], None)
        nonce = os.urandom(12)
        written = after.encrypt(nonce, plain, None)
        if after.decrypt(nonce, written, None) != plain:
            raise AssertionError("verify failed")
    return (time.process_time() - t0) / rows, len(values)


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
    global SERVER_PID
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
                    help="also: this many plain processes at once, each on its own id range (Dask's shards without Dask)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every figure, in turns (default 3)")
    ap.add_argument("--statements", action="store_true",
                    help="MySQL / MariaDB: also each kind of statement's server and client CPU in the run")
    ap.add_argument("--trace", action="store_true",
                    help="also: after the untraced rounds, the same drain with tracing on (contract §7), "
                         "exporting over OTLP/HTTP to a collector in this process")
    args = ap.parse_args()
    if args.database_url and args.database_url.split(":", 1)[0].split("+", 1)[0] in ("mysql", "mariadb"):
        from drain_mysql import main_mysql  # MySQL / MariaDB: benchmarks/drain_mysql.py

        return int(main_mysql(args))

    sandbox = Path(tempfile.mkdtemp(prefix="pinrotate-bench-"))
    cleanups: list[Callable[[], None]] = []
    try:
        if args.database_url:
            url = args.database_url
        else:
            server = embedded_server(sandbox / "pgdata", cleanup_mode="delete")
            cleanups.append(server.cleanup)
            url = server.get_uri()
        SERVER_PID = find_server_pid(url)  # None when the server is on another machine
        provider = FileKeyProvider(sandbox / "keys.toml", create=True)
        ring = provider.load_keyring()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP SCHEMA IF EXISTS profile CASCADE")
            t0 = time.perf_counter()
            seed_persons(conn, ring, args.rows)
            seeded_s = time.perf_counter() - t0
            conn.execute("VACUUM ANALYZE profile.persons")
            server_version = conn.info.server_version
        provider.add_key()
        provider.promote("2")
        ring2 = provider.load_keyring()
        print(f"seeded {args.rows:,} persons in {seeded_s:.1f} s; PostgreSQL "
              f"{server_version}; python {sys.version.split()[0]}; {os.cpu_count()} cores")

        settings = settings_from_mapping({"database": {"url": url}, "targets": [PERSON]})
        engine = make_engine(url, pool_size=3 * args.workers + 2)
        with raw_connection(engine) as conn:
            target = resolve_target(conn, settings.targets[0])
        options = DrainOptions(batch_size=args.batch_size, workers=args.workers)

        def restore() -> None:
            restore_persons(url)

        wal: dict[str, list[int]] = {"drain": [], "update": []}

        def single(traced: bool = False) -> tuple[int, float, int, Cpu]:
            scheme = build_scheme(target, ring2, settings.keys)
            restore()
            start = wal_lsn(url)
            with RssSampler() as rss:
                busy, own, server = busy_cpu_seconds(), own_cpu_seconds(), server_cpu_snapshot()
                t0 = time.perf_counter()
                if traced:  # as a flow's drain task: its span the batches' parent, flushed when it ends
                    with tracing.span(tracing.DRAIN_SPAN, {tracing.TARGET: target.name}):
                        result = drain_target(engine, scheme, options)
                else:
                    result = drain_target(engine, scheme, options)
                secs = time.perf_counter() - t0
                cpu = Cpu(busy_cpu_seconds() - busy, own_cpu_seconds() - own, server=server_cpu_since(server))
            assert result.backlog_remaining == 0 and not result.failed, result
            wal["drain"].append(wal_bytes_since(url, start))
            return result.reencrypted, secs, rss.peak_kb, cpu

        def in_database_update() -> tuple[float, Cpu]:
            restore()
            start = wal_lsn(url)
            with psycopg.connect(url, autocommit=True) as conn:
                busy, server = busy_cpu_seconds(), server_cpu_snapshot()
                t0 = time.perf_counter()
                conn.execute("UPDATE profile.persons SET key_version = key_version + 1")  # the same rows
                secs = time.perf_counter() - t0
                cpu = Cpu(busy_cpu_seconds() - busy, server=server_cpu_since(server))
                wal["update"].append(wal_bytes_since(url, start))
                conn.execute("UPDATE profile.persons SET key_version = key_version - 1")
            return args.rows / secs, cpu

        single()  # warm-up, untimed
        wal["drain"].clear()
        raw = {"database": {"url": url}, "keys": {"provider": "file", "file": str(sandbox / "keys.toml")},
               "job": {"batch_size": args.batch_size, "inter_batch_delay": 0}, "targets": [PERSON]}
        drains: list[float] = []
        updates: list[float] = []
        dasks: list[float] = []
        parallels: list[float] = []
        cpus: dict[str, list[Cpu]] = {"drain": [], "update": [], "dask": [], "processes": []}
        peak_kb = 0
        worker_peaks: dict[str, int] = {}
        dask_costs: list[tuple[DaskCosts, float]] = []
        plain = 0
        last = (0, 0.0)
        for round_no in range(1, args.repeat + 1):
            moved, secs, peak, cpu = single()
            cpus["drain"].append(cpu)
            peak_kb = peak_kb or peak  # the first round's: later rounds' process also hosts Dask's scheduler
            last = (moved, secs)
            drains.append(moved / secs)
            rate, cpu = in_database_update()
            updates.append(rate)
            cpus["update"].append(cpu)
            line = (f"round {round_no}/{args.repeat}: drain {drains[-1]:,.0f} rows/s, "
                    f"in-database UPDATE {updates[-1]:,.0f} rows/s")
            if args.dask:
                restore()
                moved, secs, worker_peaks, cpu, costs = dask_run(raw, args.dask)
                dasks.append(moved / secs)
                dask_costs.append((costs, secs))
                cpus["dask"].append(cpu)
                line += (f", dask {dasks[-1]:,.0f} rows/s = {dasks[-1] / drains[-1]:.2f}x the drain, "
                         f"{dasks[-1] / updates[-1]:.2f} of the UPDATE")
            if args.processes:
                restore()
                scheme = build_scheme(target, ring2, settings.keys)
                ranges = [s.id_range for s in split_backlog(engine, scheme, options, args.processes)]  # before the clock
                moved, secs, cpu = parallel_runs(url, str(sandbox / "keys.toml"), args.batch_size, ranges)
                parallels.append(moved / secs)
                cpus["processes"].append(cpu)
                plain = len(ranges)  # fewer than asked on a small backlog: a range is at least 25 batches
                line += f", {plain} plain processes {parallels[-1]:,.0f} rows/s"
            print(line, flush=True)

        drain_rate, update_rate = statistics.median(drains), statistics.median(updates)
        print(f"drain: {last[0]:,} rows in {last[0] / drain_rate:.2f} s = {drain_rate:,.0f} rows/s "
              f"(median of {args.repeat}; batch {args.batch_size}, workers {args.workers})")
        if args.trace:
            from benchmarks.trace_cost import traced_rounds

            traced_rounds(single, args.repeat, drain_rate, [c.python for c in cpus["drain"]], args.rows, cleanups)
        print(f"peak RSS during the drain: {peak_kb / 1024:.1f} MiB")
        if args.processes:
            rate = statistics.median(parallels)
            print(f"{plain} plain processes on id ranges: {args.rows:,} rows in {args.rows / rate:.2f} s = "
                  f"{rate:,.0f} rows/s; vs one process = {rate / drain_rate:.2f}x; / UPDATE = {rate / update_rate:.2f}")
        if args.dask:
            rate = statistics.median(dasks)
            print(f"dask, {args.dask} processes: {args.rows:,} rows in {args.rows / rate:.2f} s = {rate:,.0f} rows/s; "
                  f"vs one process = {rate / drain_rate:.2f}x; dask / UPDATE = {rate / update_rate:.2f} (medians)")
            print("peak RSS per Dask worker: " + ", ".join(f"{kb / 1024:.1f} MiB" for kb in worker_peaks.values()))
            worker_s = statistics.median(args.dask * secs for _, secs in dask_costs)
            print(f"dask, fixed costs (medians, seconds of worker time of {worker_s:.1f}): planning the shards "
                  f"{statistics.median(c.planning for c, _ in dask_costs):.2f}, opening the run in each shard "
                  f"{statistics.median(c.setup for c, _ in dask_costs):.2f}, workers done while another drains "
                  f"{statistics.median(c.idle_at_end for c, _ in dask_costs):.2f}")
        restore()
        provider.add_key()  # a new key, not current: the loop writes it by hand
        ring_now = FileKeyProvider(sandbox / "keys.toml").load_keyring()
        newest = ring_now.ids()[-1]
        loop_ciphers = AesGcmCipherSet(type(ring_now)(current=newest, keys=ring_now.keys, source="bench"))
        loop_rate = row_at_a_time(url, loop_ciphers, min(args.sample, args.rows), int(newest))
        engine.dispose()

        print(f"in-database UPDATE of the same rows: {update_rate:,.0f} rows/s; drain / UPDATE = {drain_rate / update_rate:.2f}")

        def median_cpu(name: str) -> Cpu:
            runs = cpus[name]
            driver = [c.driver for c in runs if c.driver is not None]
            return Cpu(statistics.median(c.busy for c in runs), statistics.median(c.python for c in runs),
                       statistics.median(driver) if driver else None, statistics.median(c.server for c in runs))

        cores = os.cpu_count() or 1
        drain_cpu = median_cpu("drain")
        print(f"CPU, drain: {drain_cpu.per_row(args.rows)}; {drain_cpu.busy / (args.rows / drain_rate):.2f} "
              f"of {cores} cores busy")
        if cpus["dask"]:
            print(f"CPU, dask: {median_cpu('dask').per_row(args.rows)}")
        if cpus["processes"]:
            print(f"CPU, {plain} plain processes: {median_cpu('processes').per_row(args.rows)}")
        update_cpu = median_cpu("update")
        print(f"CPU, in-database UPDATE: {update_cpu.per_row(args.rows)}")
        pg_drain = (drain_cpu.busy - drain_cpu.python) / args.rows
        pg_update = (update_cpu.busy - update_cpu.python) / args.rows
        print(f"PostgreSQL and the rest per row: drain / UPDATE = {pg_drain / pg_update:.2f}")
        if SERVER_PID is not None:
            print(f"PostgreSQL server processes per row (exact, from /proc): drain / UPDATE = "
                  f"{drain_cpu.server / update_cpu.server:.2f}")
        sample = min(args.rows, 50_000)
        aead = statistics.median(bare_aead_per_row(url, ring.keys["1"].material, ring2.keys[ring2.current].material,
                                                   sample)[0] for _ in range(3))
        print(f"bare AEAD work (decrypt, encrypt, verify-decrypt of every value; {sample:,} rows, median of 3): "
              f"{aead * 1e6:.1f} us per row; drain's Python / bare AEAD = {drain_cpu.python / args.rows / aead:.2f}")
        print(f"WAL per row (medians): drain {statistics.median(wal['drain']) / args.rows:,.0f} B, "
              f"in-database UPDATE {statistics.median(wal['update']) / args.rows:,.0f} B")
        cap = cores / (drain_cpu.busy / args.rows)
        print(f"at the drain's CPU per row, {cores} cores (PostgreSQL's included) cap any number of drain processes "
              f"at about {cap:,.0f} rows/s = {cap / drain_rate:.2f}x one process, {cap / update_rate:.2f} of the UPDATE")
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
