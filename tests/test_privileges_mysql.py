"""Least privilege on MariaDB (issue 32): the bodies of tests/test_privileges.py with real users
(``CREATE USER`` with a random name, dropped at the end) on the machine's MariaDB: a read-only
auditor inventories and gates with the owner's answer and cannot run; a user lacking a grant gets
one line naming it, and nothing is written. (The ctid / xmin test is PostgreSQL's alone: MySQL has
no row versions. That the printed GRANTs are enough to run, column by column and nothing wider, is
mysql_contract/test_cli_on_mariadb's grants test, which runs the rotation as a user holding exactly
them: its twin here repeated it.)

The Pin profile's MySQL schema (tests/mysql_contract/pin_data.py), its values made by the tests' own
AES-GCM code; TEST keys only, under random key versions.
"""

from __future__ import annotations

import contextlib
import secrets
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pymysql
import pytest

from pinrotate_core.engines.mysql import bookkeeping as books
from tests import test_privileges as privileges
from tests.mariadb_server import MariaDbServer
from tests.mysql_contract.pin_data import install_pin
from tests.mysql_contract.support import connect, write_toml

pytestmark = pytest.mark.mysql


class MariaDbRolesDb:
    """The Pin profile in the test's fresh MariaDB database as ``privileges.RolesDb``."""

    persons, business_update = "persons", "version = version + 1"

    def __init__(self, server: MariaDbServer, database: str, tmp: Path, rows: int) -> None:
        self.server, self.database, self.tmp, self.rows = server, database, tmp, rows
        self.pin = install_pin(server, database, tmp, persons=rows, documents=2)
        self.old, self.new = self.pin.old, self.pin.promote_new_key()
        self.config = self.pin.config()
        self.persons_granted = f"`{database}`.`persons`"
        self.made: list[str] = []

    def make_role(self, prefix: str) -> str:
        user = f"pinrotate_{prefix}_{secrets.token_hex(4)}"
        self.as_owner([f"CREATE USER '{user}'@'%'"])
        self.made.append(user)
        return user

    def drop_roles(self) -> None:
        self.as_owner([f"DROP USER IF EXISTS '{user}'@'%'" for user in self.made])

    def account(self, role: str) -> str:
        return f"{role}@%"  # CURRENT_USER()

    def as_owner(self, statements: Sequence[str]) -> None:
        """Each statement as printed (text, no parameters), as the mysql client runs it."""
        with contextlib.closing(connect(self.server, None, multi=True)) as conn, conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
                while cur.nextset():
                    pass

    def config_as(self, role: str) -> str:
        doc = tomllib.loads(self.config.read_text(encoding="utf-8"))
        doc["database"]["url"] = f"mysql://{role}@{self.server.host}:{self.server.port}/{self.database}"
        return str(write_toml(self.tmp / f"{role}.toml", doc))

    def key_versions(self) -> dict[Any, int]:
        return self.pin.key_versions("persons")

    def update_refused(self, role: str, assignment: str) -> None:
        with contextlib.closing(pymysql.connect(host=self.server.host, port=self.server.port, user=role,
                                                database=self.database, autocommit=True)) as conn, \
                conn.cursor() as cur, pytest.raises(pymysql.err.OperationalError, match="114[23]"):
            cur.execute(f"UPDATE {self.persons} SET {assignment}")  # 1142 / 1143: table / column access denied

    def grant_half(self, role: str) -> None:
        # The bookkeeping tables are there and granted: what is missing is on the target alone.
        # Half a grant: SELECT on the ciphertexts only, no UPDATE.
        self.as_owner([books.CREATE_DATABASE, books.CREATE_TABLES[books.KEY_CHECKS],
                       f"GRANT SELECT, INSERT ON pinrotate.key_checks TO '{role}'@'%'",
                       f"GRANT SELECT (id, first_name_cipher) ON {self.persons_granted} TO '{role}'@'%'"])


@contextlib.contextmanager
def roles_db(mariadb: MariaDbServer, database: str, tmp: Path, rows: int) -> Iterator[MariaDbRolesDb]:
    db = MariaDbRolesDb(mariadb, database, tmp, rows)
    try:
        yield db
    finally:
        db.drop_roles()


@pytest.mark.server_wide  # the two gates sweep every database of the server: both must see the same one
def test_a_read_only_auditor_inventories_and_gates_with_the_owners_answer_and_cannot_run_on_mariadb(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    with roles_db(mariadb, mysql_database, tmp_path, 30) as db:
        privileges.assert_a_read_only_auditor_reads_as_the_owner_and_cannot_run(db)


def test_a_role_without_grants_gets_one_line_naming_the_missing_privilege_on_mariadb(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    with roles_db(mariadb, mysql_database, tmp_path, 10) as db:
        privileges.assert_a_role_without_grants_gets_one_line(db)
