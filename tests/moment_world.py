"""The databases the tests of tests/test_gate_moment.py run on (issue 32): a ``MomentWorld`` holds what
differs between PostgreSQL and MariaDB (DDL, the mover's statements, where the gate's read can be
interrupted right after its snapshot), never an assertion. TEST keys only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.engines.postgresql import snapshot as snapshot_module
from pinrotate_core.rotation import retire_gate  # by the URL's engine, as the command line asks it

from .test_targets import create_people, settings_for


class MomentWorld(Protocol):
    """A fresh database of one engine for the gate's tests that apply to both (test_gate_moment.py,
    test_gate_discover.py; tests/test_gate_moment_mysql.py has the MariaDB one): the SQL that
    differs, never an assertion. ``schema`` is another schema (PostgreSQL) or database (MySQL)."""

    url: str
    keys_file: Path
    blob: str  # the column type of a binary copy
    renamed_read_as: str  # "old" (PostgreSQL: by identity, under its snapshot name) or "new"

    def execute(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]: ...
    def create_people(self) -> None: ...
    def label(self, table: str) -> str: ...
    def create_like(self, new: str, old: str) -> str: ...
    def rename(self, old: str, new: str) -> str: ...
    def move(self, source: str, destination: str) -> list[str]: ...
    def session(self) -> AbstractContextManager[Callable[[str], object]]: ...
    def after_snapshot(self, monkeypatch: pytest.MonkeyPatch, statements: list[str], *, target: bool) -> None: ...
    def schema(self, name: str, *, create: bool) -> str: ...
    def base64(self, expression: str) -> str: ...
    def create_secrets(self) -> None: ...
    def sealed(self, schema: str) -> str: ...
    def locked_by_ddl(self, table: str, monkeypatch: pytest.MonkeyPatch) -> AbstractContextManager[str]: ...


class PgMoment:
    blob = "bytea"
    renamed_read_as = "old"

    def __init__(self, url: str, conn: psycopg.Connection[Any], keys_file: Path) -> None:
        self.url, self.conn, self.keys_file = url, conn, keys_file

    def execute(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(statement, params)
        return list(cur.fetchall()) if cur.description else []

    def create_people(self) -> None:
        create_people(self.conn, self.keys_file)

    def label(self, table: str) -> str:
        return f"public.{table}"

    def create_like(self, new: str, old: str) -> str:
        return f"CREATE TABLE {new} (LIKE {old} INCLUDING DEFAULTS)"

    def rename(self, old: str, new: str) -> str:
        return f"ALTER TABLE {old} RENAME TO {new}"

    def move(self, source: str, destination: str) -> list[str]:
        # The application's archive job: one statement, nothing new written under the key.
        return [f"WITH d AS (DELETE FROM {source} WHERE id = 1000 RETURNING *) INSERT INTO {destination} SELECT * FROM d"]

    @contextlib.contextmanager
    def session(self) -> Iterator[Callable[[str], object]]:
        with psycopg.connect(self.url, autocommit=True) as other:
            yield other.execute

    def schema(self, name: str, *, create: bool) -> str:
        return f"CREATE SCHEMA {name}" if create else f"DROP SCHEMA {name} CASCADE"

    def base64(self, expression: str) -> str:
        return f"translate(encode({expression}, 'base64'), E'\\n', '')"

    def sealed(self, schema: str) -> str:
        """A column type an application made for its ciphertexts (a domain: the sweep follows it)."""
        self.execute(f"CREATE DOMAIN {schema}.sealed AS varchar(500)")
        return f"{schema}.sealed"

    def create_secrets(self) -> None:
        from .test_gate_discover import create_secrets

        create_secrets(self.conn)

    @contextlib.contextmanager
    def locked_by_ddl(self, table: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
        """A migration holding ACCESS EXCLUSIVE on ``table``, not committed yet; the sweep's lock_timeout
        (5 s) cut to a quarter of a second (the lock and the refusal are real either way). Yields the
        start of the reason the sweep gives."""
        monkeypatch.setattr(snapshot_module, "LOCK_TIMEOUT", "250ms")
        with psycopg.connect(self.url) as ddl:
            ddl.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            yield f"cannot read {self.label(table)} (LockNotAvailable, SQLSTATE 55P03)"
            ddl.rollback()

    def after_snapshot(self, monkeypatch: pytest.MonkeyPatch, statements: list[str], *, target: bool) -> None:
        """Run ``statements`` in another session right after the gate planned from its snapshot, before it
        reads (the first archive, or the first target, it holds): the rename / drop / rewrite of an archive
        job, deterministically."""
        done = [False]

        def first_time() -> None:
            if not done[0]:
                done[0] = True
                with self.session() as run:
                    for statement in statements:
                        run(statement)

        if target:
            real_target = snapshot_module.hold_target

            def hold_target(conn: psycopg.Connection[Any], relation: Any, label: str) -> str | None:
                first_time()
                return real_target(conn, relation, label)

            monkeypatch.setattr("pinrotate_core.gate.look.hold_target", hold_target)
            return
        real = snapshot_module.hold

        def hold(conn: psycopg.Connection[Any], oid: int, label: str) -> str | None:
            if label.startswith("public.people_archive"):
                first_time()
            return real(conn, oid, label)

        monkeypatch.setattr("pinrotate_core.gate.discover.hold", hold)


def rotated(world: MomentWorld) -> tuple[bytes, Any]:
    """``people`` rotated onto key 2; returns a ciphertext under key 1 (kept from before the run)."""
    world.create_people()
    ((old,),) = world.execute("SELECT name_cipher FROM people WHERE id = 1")
    settings = settings_for(world.url, world.keys_file)
    assert rotation.run_rotation(settings).exit_code == 0
    assert retire_gate(settings, "1").open  # nothing left: the gate opens (no false closed)
    return bytes(old), settings
