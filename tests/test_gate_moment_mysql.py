"""The gate reads one moment of the whole server, completely, on MariaDB (contract §6, issue 32): the
tests of tests/test_gate_moment.py whose subject a MySQL server has, their bodies run unchanged on a
``MariaDbMoment``. A consistent snapshot does not hold DDL back on InnoDB: a table dropped, renamed,
truncated or replaced after ``START TRANSACTION WITH CONSISTENT SNAPSHOT`` is gone from the catalog
or fails to read (error 1412); the gate must then say so, never read it as empty.

A table renamed after the snapshot is read under its new name (its rows as at the snapshot); its old
name is also UNREADABLE (the catalog cannot tell a rename from a drop): closed either way.

Not twinned (PostgreSQL's own subjects): ranges, composites, arrays, hstore, large objects, foreign
tables, partitions left DETACH PENDING, other sessions' temporary tables, a writer's xid at the
snapshot; the trial's known-answer vector needs no database; the NULL key version of an out-of-scope
row is test_counts_both_engines'; no sample (MariaDB's sweep has no sampling path to leave). The gate
sweeps the whole server: a mariadbd of the module's own (tests/mariadb_server.private_mariadb).
TEST keys only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest

from pinrotate_core.engines.mysql import gate as gate_checks_module
from pinrotate_core.engines.mysql.gate import GATE_CHECKS
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

from . import test_gate_moment as moment
from .test_gate_discover import fpc1_value
from .test_targets import ROWS

pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_gate_moment_mysql")]


class MariaDbMoment:
    """``moment_world.MomentWorld`` on a fresh database of the module's MariaDB."""

    blob = "varbinary(255)"
    renamed_read_as = "new"  # the catalog names a table as it is now; its rows are the snapshot's

    def __init__(self, server: MariaDbServer, database: str, keys_file: Path) -> None:
        self.server, self.database, self.keys_file = server, database, keys_file
        self.url = server.url(database)

    def execute(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with contextlib.closing(self.server.connect(self.database)) as conn, conn.cursor() as cur:
            cur.execute(statement, params or None)
            return list(cur.fetchall())

    def create_people(self) -> None:
        """test_targets.create_people's ``people`` (ROWS rows under key 1, key 2 current), in MariaDB's types."""
        provider = FileKeyProvider(self.keys_file, create=True)
        ciphers = AesGcmCipherSet(provider.load_keyring())
        self.execute("CREATE TABLE people (id bigint PRIMARY KEY, tenant varchar(8) NOT NULL, key_version int NOT NULL,"
                     " name_cipher varbinary(255), note text, updated_at datetime(6) NOT NULL DEFAULT '2024-01-01')")
        rows = [(i, "a" if i % 2 else "b", ciphers.encrypt_current(f"name {i}".encode())) for i in range(1, ROWS + 1)]
        self.execute("INSERT INTO people (id, tenant, key_version, name_cipher) VALUES "
                     + ", ".join(["(%s, %s, 1, %s)"] * len(rows)), tuple(x for row in rows for x in row))
        provider.add_key()
        provider.promote("2")

    def label(self, table: str) -> str:
        return f"{self.database}.{table}"

    def create_like(self, new: str, old: str) -> str:
        return f"CREATE TABLE {new} LIKE {old}"

    def rename(self, old: str, new: str) -> str:
        return f"RENAME TABLE {old} TO {new}"

    def move(self, source: str, destination: str) -> list[str]:
        # The application's archive job: one transaction, nothing new written under the key.
        return ["START TRANSACTION", f"INSERT INTO {destination} SELECT * FROM {source} WHERE id = 1000",
                f"DELETE FROM {source} WHERE id = 1000", "COMMIT"]

    @contextlib.contextmanager
    def session(self) -> Iterator[Callable[[str], object]]:
        with contextlib.closing(self.server.connect(self.database)) as other, other.cursor() as cur:
            cur.execute("SET lock_wait_timeout = 10")  # a DDL the gate holds back fails the test, never hangs it
            yield cur.execute

    def schema(self, name: str, *, create: bool) -> str:
        return f"CREATE DATABASE {name}" if create else f"DROP DATABASE {name}"

    def base64(self, expression: str) -> str:
        return f"REPLACE(TO_BASE64({expression}), '\\n', '')"  # TO_BASE64 wraps its lines at 76

    def sealed(self, schema: str) -> str:
        return "varchar(500)"  # MySQL has no domains

    def create_secrets(self) -> None:
        """test_gate_discover.create_secrets' ``secrets``: every value already on the current key k3."""
        self.execute("CREATE TABLE secrets (id bigint PRIMARY KEY, secret text, doc json)")
        self.execute("INSERT INTO secrets (id, secret) VALUES " + ", ".join(["(%s, %s)"] * 5),
                     tuple(x for i in range(1, 6) for x in (i, fpc1_value("k3"))))

    @contextlib.contextmanager
    def locked_by_ddl(self, table: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
        """A session holding ``LOCK TABLES table WRITE`` (what an ALTER holds while it copies); the gate's
        metadata lock wait (LOCK_WAIT_S, 5 s) cut to one second. Yields the start of the sweep's reason."""
        monkeypatch.setattr(gate_checks_module, "LOCK_WAIT_S", 1)
        with contextlib.closing(self.server.connect(self.database)) as ddl, ddl.cursor() as cur:
            cur.execute(f"LOCK TABLES {table} WRITE")
            yield f"cannot read {self.label(table)} for the sweep (OperationalError, error 1205)"
            cur.execute("UNLOCK TABLES")

    def after_snapshot(self, monkeypatch: pytest.MonkeyPatch, statements: list[str], *, target: bool) -> None:
        """Run ``statements`` in another session right after the gate's first snapshot began, before it
        read anything (targets and archives alike): InnoDB holds no DDL back until a table is read."""
        real = GATE_CHECKS.snapshot
        done = [False]

        @contextlib.contextmanager
        def snapshot(conn: pymysql.Connection) -> Iterator[None]:  # type: ignore[type-arg]
            with real(conn):
                if not done[0]:
                    done[0] = True
                    with self.session() as run:
                        for statement in statements:
                            run(statement)
                yield

        monkeypatch.setattr(GATE_CHECKS, "snapshot", snapshot)


@pytest.fixture
def world(mariadb: MariaDbServer, mysql_database: str, keys_file: Path) -> MariaDbMoment:
    return MariaDbMoment(mariadb, mysql_database, keys_file)


def test_a_row_moved_between_an_archive_and_a_target_in_one_transaction_never_opens_the_gate_on_mariadb(
        world: MariaDbMoment) -> None:
    # Half of PostgreSQL's time: still a dozen gates, each with the mover's moves between its reads.
    moment.assert_a_row_moved_between_an_archive_and_a_target_never_opens_the_gate(world, seconds=1.5)


def test_an_archive_renamed_after_the_snapshot_is_still_read_on_mariadb(
        world: MariaDbMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    moment.assert_an_archive_renamed_after_the_snapshot_is_still_read(world, monkeypatch)


@pytest.mark.parametrize("statement", ["DROP TABLE people_archive", "TRUNCATE people_archive"])
def test_an_archive_dropped_or_truncated_after_the_snapshot_is_unreadable_never_nothing_there_on_mariadb(
        statement: str, world: MariaDbMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    moment.assert_an_archive_dropped_or_truncated_after_the_snapshot_is_unreadable(world, statement, monkeypatch)


def test_a_target_renamed_away_and_replaced_after_the_snapshot_is_blocked_on_mariadb(
        world: MariaDbMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    moment.assert_a_target_renamed_away_and_replaced_after_the_snapshot_is_blocked(world, monkeypatch)


def test_a_target_locked_by_ddl_past_the_lock_wait_is_blocked_named_on_mariadb(
        world: MariaDbMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    moment.assert_a_target_locked_by_ddl_past_the_lock_timeout_is_blocked_named(world, monkeypatch)


def test_the_runs_gate_section_is_the_deep_verdict_of_gate_retire_on_mariadb(world: MariaDbMoment) -> None:
    moment.assert_the_runs_gate_section_is_the_deep_verdict_of_gate_retire(world)
