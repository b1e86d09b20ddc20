"""The floor of a client's rotation: PostgreSQL's CPU and WAL per row for the bare statements, no crypto.

    python benchmarks/floor.py                         # 200,000 person rows, embedded PostgreSQL
    python benchmarks/floor.py --rows 1000000 --repeat 2
    python benchmarks/floor.py --shapes update,id_locked,blocks_locked

Prints figures, asserts nothing. Every shape reads the stale rows of the Person table and writes
new bytes of the same length (the values read, reversed) with ``key_version = 2``, in batches of
``--batch-size`` rows, one transaction per batch, as the drain does but with no crypto and no
bookkeeping: what any
client must at least cost the server to rotate these rows. Each is compared with the in-database
``UPDATE ... SET key_version = key_version + 1`` of the same rows (no client at all).

PostgreSQL's CPU is counted exactly from ``/proc``: the server's processes (postmaster, live
children, and children that ended, through the postmaster's cutime), so it holds on a busy machine.
WAL bytes come from ``pg_current_wal_insert_lsn()``; a checkpoint in the middle of a figure adds
full-page images to it (seen at 1M rows), so compare WAL at 200k rows.

Shapes:
- ``id_locked``: the drain before its row-version guard: keyset on the primary key (``id > last ORDER BY id LIMIT n``),
  rows locked ``FOR NO KEY UPDATE SKIP LOCKED``, the write joined on the primary key.
- ``id_locked_pipelined``: the same with session-level timeouts and psycopg's pipeline mode (two
  round trips a batch instead of seven).
- ``id_locked_ctid``: that, with the write joined on ``ctid`` (no second primary-key probe).
- ``id_optimistic``: no row lock; the write, joined on the primary key, compares ``xmin`` instead.
- ``id_optimistic_ctid``: no row lock; the write finds each row by ``ctid`` and compares ``xmin``
  (the drain's shape now).
- ``read_locked`` / ``read``: the read of ``id_locked`` alone, with and without its row locks
  (each batch rolled back): what the write adds is the difference.
- ``blocks_locked`` / ``blocks_optimistic``: batches as ranges of heap blocks (TID range scans,
  physical order), the write joined on ``ctid``.
- ``drain``: not a bare shape: the drain itself (crypto, its counts, three pipelined connections),
  so that it is compared with the floor of its own shape in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import postgres
from psycopg.adapt import Dumper, Loader
from psycopg.pq import Format

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import drain as bench
from pinrotate_core.config import settings_from_mapping
from pinrotate_core.db import make_engine, raw_connection
from pinrotate_core.drain import DrainOptions, drain_target
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.schemes.registry import build_scheme
from pinrotate_core.targets import resolve_target

COLS = ["first_name_cipher", "last_name_cipher", "middle_name_cipher", "birth_date_cipher"]
SETS = ", ".join(f"{c} = u.c{i}" for i, c in enumerate(COLS)) + ", key_version = 2"
VALUES = ", ".join("%b::bytea[]" for _ in COLS)
NAMES = ", ".join(f"c{i}" for i in range(len(COLS)))


class Tid(bytes):
    """A ``ctid`` as PostgreSQL sends it in binary (block, line pointer), sent back the same way."""


class _TidLoader(Loader):
    format = Format.BINARY

    def load(self, data: Any) -> Tid:
        return Tid(data)


class _TidDumper(Dumper):
    format = Format.BINARY
    oid = postgres.types["tid"].oid

    def dump(self, obj: Any) -> bytes:
        return bytes(obj)


def adapt_tids(conn: psycopg.Connection[Any]) -> None:
    """Load ``tid`` values as ``Tid`` and send ``Tid`` (and lists of them) back as ``tid`` (binary)."""
    conn.adapters.register_loader("tid", _TidLoader)
    conn.adapters.register_dumper(Tid, _TidDumper)


def _session(conn: psycopg.Connection[Any], pipelined: bool) -> None:
    adapt_tids(conn)
    for setting in ("enable_hashjoin = off", "enable_mergejoin = off", "synchronous_commit = off"):
        conn.execute(f"SET {setting}")
    if pipelined:  # once a session, not SET LOCAL in every batch
        for setting in ("lock_timeout = '5s'", "statement_timeout = '60s'", "idle_in_transaction_session_timeout = '60s'"):
            conn.execute(f"SET {setting}")


def _begin(conn: psycopg.Connection[Any], pipelined: bool, query: str, params: list[Any]) -> list[tuple[Any, ...]]:
    cur = conn.cursor(binary=True)
    if pipelined:
        with conn.pipeline():
            conn.execute("BEGIN")
            cur.execute(query, params)
    else:
        conn.execute("BEGIN")
        for name in ("lock_timeout", "statement_timeout", "idle_in_transaction_session_timeout"):
            conn.execute(f"SET LOCAL {name} = '5s'")
        cur.execute(query, params)
    return cur.fetchall()


def _commit(conn: psycopg.Connection[Any], pipelined: bool, update: str, params: list[Any]) -> None:
    if pipelined:
        with conn.pipeline():
            conn.cursor(binary=True).execute(update, params)
            conn.execute("COMMIT")
    else:
        conn.cursor(binary=True).execute(update, params)
        conn.execute("COMMIT")


def _write(conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]], pipelined: bool, ctid: bool, lock: bool) -> None:
    """rows: (id, ctid, xmin, *values)."""
    cols = list(zip(*rows))
    # New bytes of the same length, as new ciphertexts are: writing back the bytes read would let
    # PostgreSQL log only what changed (an update's WAL record leaves out the prefix and suffix it
    # shares with the old row version) and under-state the WAL and CPU of a real rotation.
    values = [[None if v is None else v[::-1] for v in cols[3 + i]] for i in range(len(COLS))]
    guard = "" if lock else " AND t.xmin = u.x::xid"
    if not ctid:
        update = (f"UPDATE profile.persons t SET {SETS} FROM unnest(%b::uuid[], %b::text[], {VALUES}) "
                  f"AS u(id, x, {NAMES}) WHERE t.id = u.id AND t.key_version < 2{guard}")
        _commit(conn, pipelined, update, [list(cols[0]), list(cols[2]), *values])
        return
    update = (f"UPDATE profile.persons t SET {SETS} FROM unnest(%b::tid[], %b::uuid[], %b::text[], {VALUES}) "
              f"AS u(ct, id, x, {NAMES}) WHERE t.ctid = u.ct AND t.id = u.id AND t.key_version < 2{guard}")
    _commit(conn, pipelined, update, [list(cols[1]), list(cols[0]), list(cols[2]), *values])


def by_id(conn: psycopg.Connection[Any], batch: int, *, pipelined: bool, ctid: bool, lock: bool,
          write: bool = True) -> int:
    """Keyset passes on the primary key. ``write`` False: every batch read (and locked) and rolled
    back; keyset pagination still walks past it, so every row is read once."""
    _session(conn, pipelined)
    last, done = None, 0
    lock_sql = " FOR NO KEY UPDATE SKIP LOCKED" if lock else ""
    while True:
        after = "" if last is None else " AND id > %s"
        query = (f"SELECT id, ctid, xmin::text, {', '.join(COLS)} FROM profile.persons "
                 f"WHERE key_version < 2{after} ORDER BY id LIMIT %s{lock_sql}")
        rows = _begin(conn, pipelined, query, ([] if last is None else [last]) + [batch])
        if not rows or not write:
            conn.execute("ROLLBACK")
        if not rows:
            return done
        if write:
            _write(conn, rows, pipelined, ctid, lock)
        done += len(rows)
        last = rows[-1][0]


def by_blocks(conn: psycopg.Connection[Any], batch: int, *, lock: bool) -> int:
    _session(conn, True)
    row = conn.execute("SELECT relpages, reltuples, pg_relation_size(oid) / current_setting('block_size')::int "
                       "FROM pg_class WHERE oid = 'profile.persons'::regclass").fetchone()
    assert row is not None
    pages, tuples, blocks = row
    step = max(1, int(batch / max(1.0, tuples / max(1, pages))))  # blocks per batch of about `batch` rows
    lock_sql = " FOR NO KEY UPDATE SKIP LOCKED" if lock else ""
    moved = 0
    for first in range(0, blocks, step):
        query = (f"SELECT id, ctid, xmin::text, {', '.join(COLS)} FROM profile.persons "
                 f"WHERE ctid >= %s::tid AND ctid < %s::tid AND key_version < 2{lock_sql}")
        rows = _begin(conn, True, query, [f"({first},0)", f"({first + step},0)"])
        if not rows:
            conn.execute("ROLLBACK")
            continue
        _write(conn, rows, True, True, lock)
        moved += len(rows)
    return moved


# The real drain, for the ``drain`` shape: set by main() once the table is seeded and key 2 current.
_DRAIN: dict[str, Any] = {}


def real_drain(conn: psycopg.Connection[Any], batch: int) -> int:
    """The drain itself (crypto, bookkeeping, three pipelined connections) on the same rows, in the
    same run as the bare shapes: how far above its own shape's floor it is."""
    scheme = build_scheme(_DRAIN["target"], _DRAIN["keyring"], _DRAIN["settings"].keys)
    return drain_target(_DRAIN["engine"], scheme, DrainOptions(batch_size=batch)).reencrypted


def in_database_update(conn: psycopg.Connection[Any], batch: int) -> int:
    return conn.execute("UPDATE profile.persons SET key_version = key_version + 1").rowcount


SHAPES: dict[str, Callable[[psycopg.Connection[Any], int], int]] = {
    "update": in_database_update,
    "id_locked": lambda c, b: by_id(c, b, pipelined=False, ctid=False, lock=True),
    "id_locked_pipelined": lambda c, b: by_id(c, b, pipelined=True, ctid=False, lock=True),
    "id_locked_ctid": lambda c, b: by_id(c, b, pipelined=True, ctid=True, lock=True),
    "id_optimistic": lambda c, b: by_id(c, b, pipelined=False, ctid=False, lock=False),
    "id_optimistic_ctid": lambda c, b: by_id(c, b, pipelined=True, ctid=True, lock=False),
    "read_locked": lambda c, b: by_id(c, b, pipelined=False, ctid=False, lock=True, write=False),
    "read": lambda c, b: by_id(c, b, pipelined=False, ctid=False, lock=False, write=False),
    "blocks_locked": lambda c, b: by_blocks(c, b, lock=True),
    "blocks_optimistic": lambda c, b: by_blocks(c, b, lock=False),
    "drain": real_drain,
}


def measure(url: str, shape: str, rows: int, batch: int) -> tuple[float, float, float]:
    """(server CPU us per row, WAL bytes per row, rows/s) of one shape from the seeded table."""
    bench.restore_persons(url)
    start = bench.wal_lsn(url)
    with psycopg.connect(url, autocommit=True) as conn:
        server = bench.server_cpu_snapshot()
        t0 = time.perf_counter()
        moved = SHAPES[shape](conn, batch)
        secs = time.perf_counter() - t0
        server_s = bench.server_cpu_since(server)
        left = conn.execute("SELECT count(*) FROM profile.persons WHERE key_version < 2").fetchone()
    if shape.startswith("read"):
        left = None  # nothing written
    if moved != rows or (left and left[0]):
        raise SystemExit(f"{shape}: moved {moved} of {rows} rows")
    return server_s / rows * 1e6, bench.wal_bytes_since(url, start) / rows, rows / secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch-size", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    args = ap.parse_args()
    shapes = ["update", *[s for s in args.shapes.split(",") if s != "update"]]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s): {', '.join(unknown)}")
    with bench.counted_server("pinrotate-floor-") as (sandbox, url):
        provider = FileKeyProvider(sandbox / "keys.toml", create=True)  # test keys, thrown away
        with psycopg.connect(url, autocommit=True) as conn:
            bench.seed_persons(conn, provider.load_keyring(), args.rows)
            print(f"{args.rows:,} persons; PostgreSQL {conn.info.server_version}; batch {args.batch_size}", flush=True)
        provider.add_key()
        provider.promote("2")
        settings = settings_from_mapping({"database": {"url": url}, "targets": [bench.PERSON]})
        _DRAIN["engine"] = make_engine(url, pool_size=5)
        with raw_connection(_DRAIN["engine"]) as conn:
            _DRAIN["target"] = resolve_target(conn, settings.targets[0])
        _DRAIN.update(settings=settings, keyring=provider.load_keyring())
        figures: dict[str, list[tuple[float, float, float]]] = {s: [] for s in shapes}
        for round_no in range(1, args.repeat + 1):
            for shape in shapes:
                cpu, wal, rate = measure(url, shape, args.rows, args.batch_size)
                figures[shape].append((cpu, wal, rate))
                print(f"round {round_no}: {shape:20} PostgreSQL {cpu:5.1f} us/row, WAL {wal:5.0f} B/row, "
                      f"{rate:9,.0f} rows/s", flush=True)
        update = statistics.median(f[0] for f in figures["update"]) or float("nan")  # too few rows to count
        for shape in shapes:
            cpu = statistics.median(f[0] for f in figures[shape])
            wal = statistics.median(f[1] for f in figures[shape])
            print(f"median {shape:20} PostgreSQL {cpu:5.1f} us/row = {cpu / update:.2f}x the UPDATE; WAL {wal:.0f} B/row")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
