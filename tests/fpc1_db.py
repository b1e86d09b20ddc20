"""One database of the fpc1 tests on either engine (issue 32): the test bodies of
tests/test_fpc1_migration.py and tests/test_conflicts.py run on PostgreSQL (``PgFpc1Db``) and on
MariaDB (``MariaFpc1Db``) through this small surface. Only what differs between the engines lives
here: how a statement is sent, the generic schema's file, a timestamp literal, a JSON column's type
and how its value reads back, and where the CONFLICT records are (read, never written).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
import pymysql

from pinrotate_core.conflicts import conflicts_table_exists
from tests.mariadb_server import MariaDbServer
from tests.mysql_contract.support import run_sql_file

TEST_DATA = Path(__file__).resolve().parent / "data"
Row = tuple[Any, ...]


class PgFpc1Db:
    """A PostgreSQL database of the tests, through one autocommit connection."""

    engine = "postgresql"
    timestamp = "'2020-01-01T00:00:00Z'"
    json_type = "jsonb"
    schema = TEST_DATA / "fpc1_generic.sql"

    def __init__(self, conn: psycopg.Connection[Any], url: str = "") -> None:
        self.conn, self.url = conn, url

    def execute(self, statement: str, params: Sequence[Any] = ()) -> list[Row]:
        cur = self.conn.execute(statement, tuple(params) or None)
        return list(cur.fetchall()) if cur.description else []

    def create_schema(self) -> None:
        self.conn.execute(self.schema.read_text(encoding="utf-8"))

    def json_value(self, value: Any) -> Any:
        return value  # psycopg reads jsonb as Python objects

    def conflict_rows(self) -> list[Row]:
        """(target, tenant, conflicts, run_id) of this database's CONFLICT records."""
        return self.execute("SELECT target, tenant, conflicts, run_id FROM pinrotate.conflicts")

    def no_conflict_records(self) -> bool:
        """No run recorded anything yet: PostgreSQL's pinrotate.conflicts does not even exist."""
        return not conflicts_table_exists(self.conn)


class MariaFpc1Db:
    """A MariaDB database of the tests: a connection per statement, autocommit (as an application's)."""

    engine = "mysql"
    timestamp = "'2020-01-01 00:00:00'"
    json_type = "json"
    schema = TEST_DATA / "fpc1_generic_mysql.sql"

    def __init__(self, server: MariaDbServer, database: str) -> None:
        self.server, self.database = server, database
        self.url = server.url(database)

    def execute(self, statement: str, params: Sequence[Any] = ()) -> list[Row]:
        with contextlib.closing(self.server.connect(self.database)) as conn, conn.cursor() as cur:
            cur.execute(statement, tuple(params) or None)
            return list(cur.fetchall())

    def create_schema(self) -> None:
        run_sql_file(self.server, self.database, self.schema)

    def json_value(self, value: Any) -> Any:
        return json.loads(value)  # MariaDB's JSON is text with a JSON_VALID check

    def conflict_rows(self) -> list[Row]:
        """(target, tenant, conflicts, run_id) of this database's records in the server's pinrotate database."""
        return self.execute("SELECT target, tenant, conflicts, run_id FROM pinrotate.conflicts"
                            " WHERE database_name = %s", (self.database,))

    def no_conflict_records(self) -> bool:
        """No run recorded anything for this database (the server's pinrotate database is shared)."""
        try:
            return not self.conflict_rows()
        except pymysql.err.ProgrammingError:  # no pinrotate.conflicts yet on this server
            return True


Fpc1Db = PgFpc1Db | MariaFpc1Db
