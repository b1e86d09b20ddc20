"""fpc1 CONFLICTs on MariaDB (issue 32): the tests of tests/test_conflicts.py whose subject is the
CONFLICT itself, their bodies run on a MariaDB database through ``MariaFpc1Db`` (tests/fpc1_db.py):
a value another run (another process, another ``PINROTATE_HOME``) moved between this run's read and
write is done, not a CONFLICT, in a text and in a JSON column; an application's edit during two
runs still is one.

Not twinned, covered on MariaDB by tests/test_mysql_bookkeeping.py (the server's ``pinrotate``
database): the record the gate reads on any host (recorded, counted by inventory per tenant, seen
by the gate, cleared by a clean run), the record's rules for complete and partial runs
(``record_conflicts_mysql`` directly), a role that may not create or read the records, and sharded
runs (through the flow, and a drain stopped at the deadline); tests/test_fpc1_migration_mysql.py
records and clears a CONFLICT as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import test_conflicts as pg
from tests.fpc1_db import MariaFpc1Db
from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

# Runs and gates sweep every database of the server: on the shared MariaDB these tests would hold it
# alone (server_wide). The module has a mariadbd of its own instead, its tests on one worker.
pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_conflicts_mysql")]


@pytest.fixture
def db(mariadb: MariaDbServer, mysql_database: str) -> MariaFpc1Db:
    return MariaFpc1Db(mariadb, mysql_database)


@pytest.mark.parametrize("target", [pg.DC, pg.LC])
def test_a_value_another_run_moved_meanwhile_is_done_not_a_conflict_on_mariadb(
        db: MariaFpc1Db, keys_file: Path, tmp_path: Path, target: str) -> None:
    pg.test_a_value_another_run_moved_meanwhile_is_done_not_a_conflict(db, keys_file, tmp_path, target)


def test_an_application_edit_during_two_runs_is_still_a_conflict_on_mariadb(
        db: MariaFpc1Db, keys_file: Path, tmp_path: Path) -> None:
    pg.test_an_application_edit_during_two_runs_is_still_a_conflict(db, keys_file, tmp_path)
