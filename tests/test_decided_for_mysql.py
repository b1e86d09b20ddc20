"""Say what was decided for what, on MariaDB (issues 32, 33): test_decided_for's assertions on a
MariaDB. One run id everywhere (the report, the log lines, the key checks recorded in the
server's ``pinrotate`` database for this database); the gate names the database, the server's own
identifier (MariaDB's ``@@server_uid``) and the keyring it decided for, in its text and its JSON.

The gate must open here, and a MySQL gate reads the whole server (its sweep, the transactions in
flight): the test is ``server_wide``, on a mariadbd of its worker's own (tests/conftest.py). The Pin profile's MySQL schema,
TEST keys only (tests/mysql_contract/pin_data.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from tests.mariadb_server import MariaDbServer
from tests.mysql_contract.pin_data import install_pin
from tests.test_decided_for import assert_one_run_id_and_a_gate_naming_its_database_and_keyring

pytestmark = pytest.mark.mysql


@pytest.mark.server_wide
def test_a_run_has_one_run_id_and_the_gate_names_its_database_and_keyring_on_mariadb(
        prefect_api: str, mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=20, documents=4)
    pin.promote_new_key()

    def recorded_by() -> set[str]:
        with contextlib.closing(mariadb.connect()) as conn, conn.cursor() as cur:
            cur.execute("SELECT recorded_by FROM pinrotate.key_checks WHERE database_name = %s", (mysql_database,))
            return {str(r[0]) for r in cur.fetchall()}

    with contextlib.closing(mariadb.connect(mysql_database)) as conn, conn.cursor() as cur:
        cur.execute("SELECT @@server_uid, DATABASE()")
        sysid, name = cur.fetchone()  # type: ignore[misc]
    assert_one_run_id_and_a_gate_naming_its_database_and_keyring(
        prefect_api, pin.config(batch_size=50), pin.keys_file, str(pin.old), recorded_by, (str(sysid), str(name)))
