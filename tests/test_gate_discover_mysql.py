"""The gate's sweep outside the configured targets on MariaDB (contract §6, issue 32): the tests of
tests/test_gate_discover.py that MariaDB's suite did not have, their bodies run unchanged on the
``MariaDbMoment`` of tests/test_gate_moment_mysql.py: binary ``aesgcm`` copies in another database
and base64 text found by trying the key on every value, the run's own gate section naming the
column, and a table held by DDL (``LOCK TABLES ... WRITE``) named UNREADABLE after a bounded wait.

Already on MariaDB: an fpc1 copy in another database (mysql_contract/test_gate_on_mariadb.py),
unreadable columns and the marker search (test_engine_mysql_gate.py). Not twinned: partitions and
materialized views, domains and jsonb paths (values outside ``json_paths`` are UNSWEPT on MySQL, by
design for now), OpenBao Transit, and the config and JSON-path checks that need no database. The gate
sweeps the whole server: a mariadbd of the module's own. TEST keys only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

from . import test_gate_discover as discover
from .test_gate_moment_mysql import MariaDbMoment

pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_gate_discover_mysql")]


@pytest.fixture
def world(mariadb: MariaDbServer, mysql_database: str, keys_file: Path) -> MariaDbMoment:
    return MariaDbMoment(mariadb, mysql_database, keys_file)


def test_an_archive_copy_of_an_fpc1_target_closes_the_gate_for_its_key_only_and_names_the_column_on_mariadb(
        world: MariaDbMoment) -> None:
    try:
        discover.assert_an_archive_copy_closes_the_gate_for_its_key_only_until_vouched_for(world)
    finally:
        world.execute("DROP DATABASE IF EXISTS archive")


def test_an_aesgcm_binary_copy_in_another_database_and_a_base64_text_copy_close_the_gate_on_mariadb(
        world: MariaDbMoment) -> None:
    try:
        discover.assert_binary_copies_elsewhere_close_the_gate_by_trying_every_value(world)
    finally:
        world.execute("DROP DATABASE IF EXISTS backup")


def test_the_runs_gate_section_sweeps_too_and_names_the_column_on_mariadb(world: MariaDbMoment) -> None:
    discover.assert_the_runs_gate_section_sweeps_too_and_names_the_column(world)


def test_a_table_locked_by_ddl_past_the_lock_wait_closes_the_gate_named_on_mariadb(
        world: MariaDbMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    discover.assert_a_table_locked_by_ddl_past_the_lock_timeout_closes_the_gate_named(world, monkeypatch)
