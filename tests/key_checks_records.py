"""What tests/test_key_identity.py asks of its database beyond pinrotate, on either engine: the
check values recorded about it (``pinrotate.key_checks``: a schema of the database on PostgreSQL,
rows naming the database in the server's ``pinrotate`` database on MySQL / MariaDB), roles that
may not write them, and pinrotate's own comparison on a given engine. Read as a user would, with
the engine's driver; never a key (the records hold check values, which the tests compare).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
import pymysql
import sqlalchemy as sa
from psycopg import sql

from pinrotate_core.commands.mysql.bookkeeping import confirm_key_identity_mysql
from pinrotate_core.config import Settings
from pinrotate_core.engines.mysql import connect as mysql_connect
from pinrotate_core.engines.mysql.bookkeeping import CREATE_DATABASE, CREATE_TABLES
from pinrotate_core.key_checks import CREATE_SQL, KeyIdentity, confirm_key_identity
from pinrotate_core.keyring import Keyring
from pinrotate_core.providers import KeyProvider
from tests.helpers import url_as
from tests.mariadb_server import MariaDbServer

Recorded = dict[str, tuple[str, str, str]]  # key id -> (check value, algorithm, recorded_by)


@dataclass(frozen=True)
class AppRole:
    name: str  # as pinrotate's refusals name it
    url: str  # the test's database, as this role


class KeyChecksDatabase(Protocol):
    url: str
    create_grant: str  # how a refusal to create the table starts the statement to run
    unreachable: str  # a URL of this engine where nobody answers

    def recorded(self) -> Recorded: ...

    def recorded_rows(self) -> list[tuple[str, str, str]]:
        """(keyring, key id, algorithm) of every check value recorded about the database, by key id."""

    def table_exists(self) -> bool:
        """Has anything written the database's key check records (on MySQL: rows about it, or the
        server's table itself when it was not there before)?"""

    def let_read_key_checks(self, role: AppRole) -> None:
        """Create the key checks table (as its owner) and let ``role`` read it, not write it."""

    def confirm(self, engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
                record: bool, run_id: str | None = None) -> KeyIdentity:
        """pinrotate's comparison with the records (and recording) on this engine."""

    @staticmethod
    def lazy_engine(url: str) -> sa.Engine | None:
        """An engine that has not reached ``url`` yet, for ``open_run`` (None: its own does not)."""


class PgKeyChecks:
    create_grant = "GRANT CREATE ON DATABASE"
    unreachable = "postgresql://nobody@127.0.0.1:1/none"

    def __init__(self, url: str, make_role: Callable[[str], str] | None = None) -> None:
        self.url, self.make_role = url, make_role

    def _rows(self, statement: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url) as conn:
            return conn.execute(statement).fetchall()

    def recorded(self) -> Recorded:
        return {r[0]: (r[1], r[2], r[3]) for r in self._rows(
            "SELECT key_id, check_value, algorithm, recorded_by FROM pinrotate.key_checks")}

    def recorded_rows(self) -> list[tuple[str, str, str]]:
        return [(r[0], r[1], r[2]) for r in self._rows(
            "SELECT keyring, key_id, algorithm FROM pinrotate.key_checks ORDER BY key_id")]

    def table_exists(self) -> bool:
        row = self._rows("SELECT to_regclass('pinrotate.key_checks') IS NOT NULL")
        return bool(row and row[0][0])

    def let_read_key_checks(self, role: AppRole) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(CREATE_SQL)
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA pinrotate TO {r}; GRANT SELECT ON pinrotate.key_checks TO {r}")
                         .format(r=sql.Identifier(role.name)))

    def confirm(self, engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
                record: bool, run_id: str | None = None) -> KeyIdentity:
        return confirm_key_identity(engine, settings, keyring, provider, record=record, run_id=run_id)

    @staticmethod
    def lazy_engine(url: str) -> sa.Engine | None:
        return None

    def app_role(self) -> AppRole:
        """A login role without CREATE on the database (the conftest's ``make_role`` drops it)."""
        assert self.make_role is not None
        name = self.make_role("ki")
        return AppRole(name, url_as(self.url, name))


class MariaKeyChecks:
    create_grant = "GRANT CREATE ON pinrotate.*"
    unreachable = "mysql://nobody@127.0.0.1:1/none"

    def __init__(self, server: MariaDbServer, database: str) -> None:
        self.server, self.database, self.url = server, database, server.url(database)
        self._table_before = self._table_on_server()

    def as_owner(self, statement: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        """``statement`` as the server's owner runs it (root: a DBA following a refusal)."""
        with contextlib.closing(self.server.connect()) as conn, conn.cursor() as cur:
            cur.execute(statement, params or None)
            return list(cur.fetchall())

    def _table_on_server(self) -> bool:
        return bool(self.as_owner("SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = 'pinrotate'"
                               " AND TABLE_NAME = 'key_checks'")[0][0])

    def recorded(self) -> Recorded:
        if not self._table_on_server():
            return {}
        return {r[0]: (r[1], r[2], r[3]) for r in self.as_owner(
            "SELECT key_id, check_value, algorithm, recorded_by FROM pinrotate.key_checks WHERE database_name = %s",
            (self.database,))}

    def recorded_rows(self) -> list[tuple[str, str, str]]:
        return [(r[0], r[1], r[2]) for r in self.as_owner(
            "SELECT keyring, key_id, algorithm FROM pinrotate.key_checks WHERE database_name = %s ORDER BY key_id",
            (self.database,))]

    def table_exists(self) -> bool:
        return bool(self.recorded()) or (self._table_on_server() and not self._table_before)

    def let_read_key_checks(self, role: AppRole) -> None:
        self.as_owner(CREATE_DATABASE)
        self.as_owner(CREATE_TABLES["key_checks"])
        self.as_owner(f"GRANT SELECT ON pinrotate.key_checks TO {role.name}")

    def confirm(self, engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
                record: bool, run_id: str | None = None) -> KeyIdentity:
        with mysql_connect.raw_connection(engine) as conn:
            return confirm_key_identity_mysql(conn, settings, keyring, provider, record=record, run_id=run_id)

    @staticmethod
    def lazy_engine(url: str) -> sa.Engine | None:
        return mysql_connect.make_engine(url, pool_size=1)  # the room's own: it connects when first asked

    @contextlib.contextmanager
    def app_role(self) -> Iterator[AppRole]:
        """A user that may read and write the test's database and nothing of pinrotate's, dropped at the end."""
        user, password = f"ki_{secrets.token_hex(4)}", secrets.token_hex(12)
        self.as_owner(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'")
        self.as_owner(f"GRANT SELECT, INSERT, UPDATE ON `{self.database}`.* TO '{user}'@'%'")
        try:
            yield AppRole(f"'{user}'@'%'", self.url.replace(f"{self.server.user}@", f"{user}:{password}@", 1))
        finally:
            with contextlib.suppress(pymysql.Error):
                self.as_owner(f"DROP USER '{user}'@'%'")
