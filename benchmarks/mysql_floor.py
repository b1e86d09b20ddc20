"""The floor of a rotation on MySQL / MariaDB: the engine room's compare-and-swap batch writes (no
crypto) beside the in-database ``UPDATE`` of the same rows, in the same run.

    python benchmarks/mysql_floor.py                               # 20,000 rows, MariaDB on 127.0.0.1:3306
    python benchmarks/mysql_floor.py --rows 100000 --batch-size 500
    python benchmarks/mysql_floor.py --database-url mysql://root@127.0.0.1:3306/

Prints figures, asserts nothing. It creates a database of its own on the server (dropped at the
end) with a Forge-like table: id, two VARCHAR cipher columns, a key version and an ``update_time
... ON UPDATE CURRENT_TIMESTAMP``. Shapes:

- ``update``: ``UPDATE t SET key_version = key_version + 1`` over every row (no client at all);
- ``update_batched``: the same in keyset batches of ``--batch-size`` rows, one transaction each;
- ``cas``: ``engines/mysql/guard.py`` as the drain runs it: read a batch (keyset, no lock), then
  in one transaction: lock ``SKIP LOCKED`` (a count), a savepoint, one UPDATE of new values (the
  values read, reversed) compared with the values read, the key version set and ``update_time``
  kept, read back and compared in the server;
- ``cas_union``: the same with the row source every server parses (one ``SELECT`` a row, ``UNION
  ALL``: MySQL before 8.0.19) instead of the server's ``VALUES`` rows.

Server CPU is read from ``/proc/<mariadbd pid>`` when the server runs on this machine (other
sessions' work on a shared server counts too); client CPU is this process's.

``--statements`` also prints, for the ``cas`` shapes, each kind of statement's share: the server's
CPU around each statement from ``/proc/<pid>/task/*/schedstat`` (nanoseconds, every thread of the
server: exact on a server of one's own, e.g. ``tests/mariadb_server.start_own_server``) and this
process's CPU inside ``execute`` (sending, and decoding what comes back).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pymysql
import pymysql.cursors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pinrotate_core.engines.mysql.catalog import CATALOG
from pinrotate_core.engines.mysql.connect import MySqlConnection, make_engine, raw_connection, server_info
from pinrotate_core.engines.mysql.guard import CasRow, MySqlCasGuard, batch_transaction


def server_cpu(conn: MySqlConnection) -> Callable[[], float | None]:
    """Seconds of CPU the server process has used, when it is local and readable."""
    with conn.cursor() as cur:
        cur.execute("SELECT @@pid_file")
        row = cur.fetchone()
    try:
        pid = int(Path(str(row[0] if row else "")).read_text().strip())
    except (OSError, ValueError):
        return lambda: None
    tick = os.sysconf("SC_CLK_TCK")

    def read() -> float | None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / tick

    return read


def server_pid(conn: MySqlConnection) -> int | None:
    with conn.cursor() as cur:
        cur.execute("SELECT @@pid_file")
        row = cur.fetchone()
    try:
        return int(Path(str(row[0] if row else "")).read_text().strip())
    except (OSError, ValueError):
        return None


class StatementCosts:
    """Server and client CPU by kind of statement, while ``active`` (PyMySQL's ``Cursor.execute``
    wrapped: call ``restore`` at the end)."""

    def __init__(self, pid: int) -> None:
        self.tasks = Path(f"/proc/{pid}/task")
        self.server: dict[str, int] = {}
        self.client: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.active = False
        self._execute = pymysql.cursors.Cursor.execute
        costs, execute = self, self._execute

        def wrapped(cur: pymysql.cursors.Cursor, query: str, args: object = None) -> int:
            if not costs.active:
                return execute(cur, query, args)
            kind = costs.kind(query)
            server0, client0 = costs.server_ns(), time.process_time()
            result = execute(cur, query, args)
            costs.client[kind] = costs.client.get(kind, 0.0) + time.process_time() - client0
            costs.server[kind] = costs.server.get(kind, 0) + costs.server_ns() - server0
            costs.count[kind] = costs.count.get(kind, 0) + 1
            return result

        pymysql.cursors.Cursor.execute = wrapped  # type: ignore[assignment,method-assign]

    def restore(self) -> None:
        pymysql.cursors.Cursor.execute = self._execute  # type: ignore[method-assign]

    def server_ns(self) -> int:
        total = 0
        for task in self.tasks.iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
        return total

    @staticmethod
    def kind(query: str) -> str:
        words = query.split(None, 3)
        head = " ".join(words[:2])
        if query.rstrip().endswith("SKIP LOCKED"):
            return f"{head} ... FOR UPDATE SKIP LOCKED (lock)"
        if head.startswith("SELECT COUNT(*)") and "STRAIGHT_JOIN" in query:
            return "SELECT COUNT(*) ... (read-back)"
        if "ORDER BY" in query[-80:]:
            return "SELECT ... ORDER BY id LIMIT (keyset read)"
        return head[:40]

    def print(self, rows: int) -> None:
        for kind in sorted(self.server, key=lambda k: -self.server[k]):
            print(f"  {kind:<46}{self.count[kind]:>6}  server {self.server[kind] / rows / 1e3:6.2f} µs"
                  f"  client {self.client[kind] / rows * 1e6:6.2f} µs a row")
        self.server.clear()
        self.client.clear()
        self.count.clear()


def fill(conn: MySqlConnection, rows: int) -> None:
    with conn.cursor() as cur:
        cur.execute("DROP TABLE IF EXISTS persons")
        cur.execute("CREATE TABLE persons (id BIGINT PRIMARY KEY, first_name_cipher VARCHAR(255),"
                    " last_name_cipher VARCHAR(255), key_version INT NOT NULL,"
                    " update_time DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP)"
                    " ENGINE = InnoDB")
        chunk = 2000
        for start in range(1, rows + 1, chunk):
            ids = range(start, min(start + chunk, rows + 1))
            values = [(i, secrets.token_urlsafe(48), secrets.token_urlsafe(48)) for i in ids]
            cur.executemany("INSERT INTO persons (id, first_name_cipher, last_name_cipher, key_version)"
                            " VALUES (%s, %s, %s, 1)", values)
        cur.execute("ANALYZE TABLE persons")
        cur.fetchall()


def reset(conn: MySqlConnection) -> None:
    with conn.cursor() as cur:
        cur.execute("UPDATE persons SET key_version = 1")


def shape_update(conn: MySqlConnection, batch: int) -> int:
    with conn.cursor() as cur:
        cur.execute("START TRANSACTION")
        cur.execute("UPDATE persons SET key_version = key_version + 1")
        n = cur.rowcount
        conn.commit()
    return n


def shape_update_batched(conn: MySqlConnection, batch: int) -> int:
    done, last = 0, 0
    with conn.cursor() as cur:
        while True:
            cur.execute("SELECT id FROM persons WHERE id > %s AND key_version < 2 ORDER BY id LIMIT %s", (last, batch))
            ids = [r[0] for r in cur.fetchall()]
            if not ids:
                return done
            with batch_transaction(conn, 1):
                cur.execute("UPDATE persons SET key_version = key_version + 1 WHERE id >= %s AND id <= %s "
                            "AND key_version < 2", (ids[0], ids[-1]))
                done += cur.rowcount
            last = ids[-1]


def shape_cas(conn: MySqlConnection, batch: int, form: str | None = None) -> int:
    table = CATALOG.read_table(conn, None, "persons")
    assert table is not None
    guard = MySqlCasGuard(table, "id", ["first_name_cipher", "last_name_cipher"], key_version="key_version",
                          stale_where="t.`key_version` < 2", form=form)
    done, last = 0, None
    while True:
        rows = guard.read_batch(conn, last, None, batch)
        if not rows:
            return done
        writes = [CasRow(r[0], (r[1], r[2]), (str(r[1])[::-1], str(r[2])[::-1])) for r in rows]
        with batch_transaction(conn, 1):
            outcome = guard.write(conn, writes, key_version=2)
            if outcome.mismatched:
                raise RuntimeError(f"{len(outcome.mismatched)} rows stored other values than written")
        done += len(outcome.written)
        last = rows[-1][0]


def shape_cas_union(conn: MySqlConnection, batch: int) -> int:
    return shape_cas(conn, batch, "union")


SHAPES: dict[str, Callable[[MySqlConnection, int], int]] = {
    "update": shape_update, "update_batched": shape_update_batched, "cas": shape_cas, "cas_union": shape_cas_union}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", default="mysql://root@127.0.0.1:3306/",
                        help="a server where this user may CREATE DATABASE (the database part is ignored)")
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--statements", action="store_true",
                        help="also each kind of statement's server and client CPU (the cas shapes)")
    args = parser.parse_args()
    base = args.database_url.rsplit("/", 1)[0]
    name = f"pinrotate_bench_{secrets.token_hex(4)}"
    admin = make_engine(f"{base}/mysql")
    with raw_connection(admin) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{name}`")
    engine = make_engine(f"{base}/{name}")
    try:
        with raw_connection(engine) as conn:
            print(f"server: {server_info(conn).label}; {args.rows:,} rows, batches of {args.batch_size}")
            fill(conn, args.rows)
            cpu = server_cpu(conn)
            pid = server_pid(conn) if args.statements else None
            costs = StatementCosts(pid) if pid is not None else None
            if args.statements and costs is None:
                print("--statements: the server's process is not readable here (remote server?)")
            print(f"{'shape':<16}{'rows':>10}{'seconds':>10}{'rows/s':>12}{'client CPU/row':>16}{'server CPU/row':>16}")
            for shape in args.shapes.split(","):
                reset(conn)
                server0, client0, wall0 = cpu(), time.process_time(), time.perf_counter()
                if costs is not None:
                    costs.active = shape.startswith("cas")
                n = SHAPES[shape](conn, args.batch_size)
                wall, client, server1 = time.perf_counter() - wall0, time.process_time() - client0, cpu()
                server = "n/a" if server0 is None or server1 is None else f"{(server1 - server0) / n * 1e6:.1f} µs"
                print(f"{shape:<16}{n:>10,}{wall:>10.2f}{n / wall:>12,.0f}{client / n * 1e6:>13.1f} µs{server:>16}")
                if costs is not None and costs.active:
                    costs.active = False
                    costs.print(n)
            if costs is not None:
                costs.restore()
    finally:
        engine.dispose()
        with contextlib.suppress(pymysql.err.MySQLError), raw_connection(admin) as conn, conn.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.dispose()


if __name__ == "__main__":
    main()
