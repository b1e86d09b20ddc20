"""``fpc1`` compare-and-swap writes and the rows an application holds locked, on MariaDB (issue 32):
the tests of tests/test_drain_cas_locks.py, their bodies run unchanged on a ``LockedCreds`` of this
module. The MySQL drain skips a locked row (``SKIP LOCKED``) and compares each value in its UPDATE;
an edit the application commits later is read again, never overwritten. A run's gate sweeps the
whole server: a mariadbd of the module's own (tests/mariadb_server.private_mariadb). TEST keys only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

from . import test_drain_cas_locks as cas
from .test_drain_cas_locks import Execute, LockedCreds

pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_drain_cas_locks_mysql")]


def session(conn: Any) -> Execute:
    def execute(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with conn.cursor() as cur:
            cur.execute(statement, params or None)
            return list(cur.fetchall())

    return execute


@pytest.fixture
def locked(mariadb: MariaDbServer, mysql_database: str) -> Iterator[LockedCreds]:
    with contextlib.closing(mariadb.connect(mysql_database)) as own, \
            contextlib.closing(mariadb.connect(mysql_database)) as app:
        cas.create_creds(session(own))
        cas.hold_locked(session(app))
        yield LockedCreds(mariadb.url(mysql_database), session(own), session(app))


def test_rows_an_application_holds_locked_are_skipped_and_left_the_others_move_without_waiting_on_mariadb(
        locked: LockedCreds, keys_file: Path) -> None:
    cas.assert_locked_rows_are_skipped_and_the_others_move_without_waiting(locked, keys_file)


def test_an_edit_made_while_the_row_was_locked_is_not_overwritten_and_moves_once_committed_on_mariadb(
        locked: LockedCreds, keys_file: Path) -> None:
    cas.assert_an_edit_made_while_the_row_was_locked_is_not_overwritten(locked, keys_file)


def test_a_row_locked_for_the_whole_run_closes_the_gate_for_its_key_and_is_no_conflict_on_mariadb(
        locked: LockedCreds, keys_file: Path) -> None:
    cas.assert_a_row_locked_for_the_whole_run_closes_the_gate_for_its_key(locked, keys_file)
