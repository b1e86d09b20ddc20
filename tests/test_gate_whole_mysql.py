"""The retire gate's verdict is whole (issue 22, contract §6) on MariaDB: tests/test_gate_whole.py's
tests, the same functions, collected here with this module's ``db``: a fresh database of the
module's own mariadbd. A gate and a run's gate section sweep every database of the server and wait
for every transaction in flight on it, so the shared MariaDB would have to be held alone meanwhile
(``server_wide``): the module has a server of its own instead, its tests on one worker (``mariadb``
and ``mysql_database``: tests/mariadb_server.private_mariadb).

Every test of test_gate_whole is about the gate, not a PostgreSQL mechanism; all but one run here.
test_the_flows_gate_artifact_is_over_every_target_for_a_run_of_one asks the Prefect flow what
test_a_run_of_one_target_reports_the_gate_closed_while_another_target_holds_the_key asks the run
(the flow's gate task is the same ``run_gate`` of the engine, rendered by the same ``reports``):
on MariaDB it would add only a Prefect server to this worker, about 10 s of the suite's time.
Keys are random TEST keys made by the tests; nothing is mocked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from pinrotate_core.commands.mysql.bookkeeping import record_conflicts_mysql
from pinrotate_core.db import make_engine
from pinrotate_core.engines.mysql.connect import raw_connection
from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

from . import test_gate_whole as on_postgresql

pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_gate_whole_mysql")]


class MariaDatabase:
    """``test_gate_whole.Database`` on a database of the module's MariaDB."""

    binary = "longblob"

    def __init__(self, server: MariaDbServer, database: str) -> None:
        self.server, self.database, self.url = server, database, server.url(database)

    def execute(self, statement: str, params: Sequence[object] = ()) -> None:
        with contextlib.closing(self.server.connect(self.database)) as conn, conn.cursor() as cur:
            cur.execute(statement, tuple(params) or None)

    def executemany(self, statement: str, rows: Sequence[Sequence[object]]) -> None:
        with contextlib.closing(self.server.connect(self.database)) as conn, conn.cursor() as cur:
            cur.executemany(statement, [tuple(r) for r in rows])

    def record_conflicts(self, target: str, by_tenant: Mapping[str, int], *, run_id: str) -> None:
        # In the server's pinrotate database, through pinrotate's own room (as a run on another host).
        engine = make_engine(self.url, pool_size=1)
        try:
            with raw_connection(engine) as conn:
                record_conflicts_mysql(conn, target, by_tenant, tenant_scope=None, complete=True, run_id=run_id)
        finally:
            engine.dispose()


@pytest.fixture
def db(mariadb: MariaDbServer, mysql_database: str) -> on_postgresql.Database:
    return MariaDatabase(mariadb, mysql_database)


@pytest.fixture
def shared(db: on_postgresql.Database, tmp_path: Path) -> on_postgresql.Shared:
    return on_postgresql.Shared(db, tmp_path)


# -- 1. one verdict over everything configured ---------------------------------------------------------
test_a_tenant_gate_stays_closed_while_another_tenant_holds_rows_on_the_key = (
    on_postgresql.test_a_tenant_gate_stays_closed_while_another_tenant_holds_rows_on_the_key)
test_a_run_of_one_target_reports_the_gate_closed_while_another_target_holds_the_key = (
    on_postgresql.test_a_run_of_one_target_reports_the_gate_closed_while_another_target_holds_the_key)
test_a_run_of_one_target_is_closed_by_conflicts_recorded_for_a_target_it_did_not_drain = (
    on_postgresql.test_a_run_of_one_target_is_closed_by_conflicts_recorded_for_a_target_it_did_not_drain)

# -- 2. rows no run takes keep the gate closed unless --erase-excluded -----------------------------------
test_excluded_rows_on_the_key_close_the_gate_until_erasing_them_is_accepted = (
    on_postgresql.test_excluded_rows_on_the_key_close_the_gate_until_erasing_them_is_accepted)
test_the_inventory_counts_excluded_values_per_rule_on_both_counting_paths = (
    on_postgresql.test_the_inventory_counts_excluded_values_per_rule_on_both_counting_paths)

# -- 3. vault-transit: retiring version N retires every older one -----------------------------------------
test_transit_values_on_any_version_up_to_the_key_block_it = (
    on_postgresql.test_transit_values_on_any_version_up_to_the_key_block_it)
