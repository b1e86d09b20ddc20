"""pinrotate never waits behind DDL on MySQL / MariaDB past a few seconds (``TABLE_LOCK_WAIT_S``).

A table's metadata lock held by DDL (an ALTER, ``LOCK TABLES ... WRITE``) makes every other
statement on the table wait: the server's default wait is a day (MariaDB) or a year (MySQL). A
run, an inventory or a gate queued there would hang, and would queue the application's own
statements behind it. Every connection pinrotate opens bounds that wait: the command ends with one
line naming what it could not read (nothing written), and the next run, once the DDL is done,
moves everything. TEST keys only.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import pytest

from pinrotate_core import rotation
from pinrotate_core.errors import PinrotateError
from tests.mariadb_server import MariaDbServer

from .test_fpc1_hold_whole_target import build, stored

pytestmark = pytest.mark.mysql


def test_a_run_behind_a_table_lock_ends_with_one_line_and_the_next_run_moves_everything(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    def execute(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with contextlib.closing(mariadb.connect(mysql_database)) as conn, conn.cursor() as cur:
            cur.execute(statement, params)
            return list(cur.fetchall())

    settings, values = build((mariadb.url(mysql_database), execute), tmp_path)
    execute("UPDATE creds SET pw = %s WHERE id = %s", (values[1], 7))  # no failing value this time
    before = stored(execute)
    outcome: list[BaseException | rotation.RunReport] = []

    def run() -> None:
        try:
            outcome.append(rotation.run_rotation(settings, expected_key="k2"))
        except PinrotateError as e:
            outcome.append(e)

    with contextlib.closing(mariadb.connect(mysql_database)) as ddl, ddl.cursor() as cur:
        cur.execute("LOCK TABLES creds WRITE")
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout=120)  # a hang fails here (the server's own wait is a day), never a speed bound
        cur.execute("UNLOCK TABLES")
    assert not worker.is_alive(), "the run waited behind the table lock"
    (ended,) = outcome
    assert isinstance(ended, PinrotateError), ended
    assert "creds" in str(ended) and "1205" in str(ended) and "\n" not in str(ended)
    assert stored(execute) == before  # nothing written

    report = rotation.run_rotation(settings, expected_key="k2")
    assert report.exit_code == 0 and report.targets["T"].reencrypted == len(before)
