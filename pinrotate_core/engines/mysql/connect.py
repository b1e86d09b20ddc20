"""Connections to MySQL 8.0+ and MariaDB 10.6+: PyMySQL through SQLAlchemy (``mysql+pymysql``).

PyMySQL is pure Python: no C client library to install or match to the server (libmysqlclient and
MariaDB Connector/C differ in auth plugins and versions), and the same driver speaks to MySQL and
MariaDB alike. Never logs a URL's password; an error names where and why, never a value.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pymysql
import sqlalchemy as sa
from pymysql.connections import Connection
from sqlalchemy.engine import make_url

from ...errors import ConfigError, DatabaseError, DatabaseUnavailable

MySqlConnection = Connection
SCHEMES = ("mysql", "mariadb")
DEFAULT_PORT = 3306
MINIMUM = {"mariadb": (10, 6), "mysql": (8, 0)}
CONNECT_TIMEOUT_S = 10
# How long any statement of pinrotate waits for a table's metadata lock held by DDL (an ALTER,
# LOCK TABLES ... WRITE): the server's default is a year (MySQL) or a day (MariaDB). Past it the
# statement fails (error 1205) and the command says so in one line (exit 4) instead of hanging,
# and a pinrotate statement never stays queued behind DDL, where it would queue the application's
# statements behind it. Set on every connection pinrotate opens (``init_command``).
TABLE_LOCK_WAIT_S = 5
LOCK_WAIT_TIMEOUT = 1205  # the error of a wait for a lock that ran out (a metadata lock held by DDL, too)
PROGRAM_NAME = "pinrotate"  # performance_schema.session_connect_attrs: how our sessions are told apart

# Refusals that trying again cannot cure: access denied (1044, 1045, 1227, 1698), unknown database (1049).
_PERMANENT_ERRNOS = frozenset({1044, 1045, 1049, 1227, 1698})


class TableLockedByDdl(DatabaseError):
    """A statement on ``table`` waited for its metadata lock past the session's lock_wait_timeout
    (an ALTER, ``LOCK TABLES ... WRITE``): the table could not be read now; ``cause`` names the
    server's error. Raised where a caller can decide without the table (the gate: BLOCKED)."""

    def __init__(self, message: str, table: str, cause: str) -> None:
        super().__init__(message)
        self.table = table
        self.cause = cause


def sqlalchemy_url(url: str) -> sa.URL:
    """``mysql://`` or ``mariadb://`` (a driver suffix is replaced) as SQLAlchemy's PyMySQL URL.

    Both map to the ``mysql`` dialect: it detects MariaDB itself, and ``mariadb+pymysql`` would
    refuse a MySQL server behind a ``mariadb://`` URL.
    """
    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError:
        raise ConfigError("database.url: not a valid database URL") from None
    if parsed.get_backend_name() not in SCHEMES:
        raise ConfigError("database.url: not a MySQL or MariaDB URL (mysql:// or mariadb://)")
    if not parsed.database:
        raise ConfigError("database.url: a MySQL / MariaDB URL names its database (mysql://user@host:3306/DATABASE)")
    return parsed.set(drivername="mysql+pymysql", query={**parsed.query, "charset": "utf8mb4"})


def make_engine(url: str, *, pool_size: int = 5) -> sa.Engine:
    engine = sa.create_engine(
        sqlalchemy_url(url),
        pool_size=pool_size,
        max_overflow=2,
        pool_pre_ping=True,
        pool_reset_on_return=None,  # raw_connection() hands every connection back rolled back
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S, "program_name": PROGRAM_NAME,
                      "init_command": f"SET SESSION lock_wait_timeout = {TABLE_LOCK_WAIT_S}"},
    )
    where = engine.url

    @sa.event.listens_for(engine, "do_connect")
    def connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        try:
            return pymysql.connect(*cargs, **cparams)
        except pymysql.err.MySQLError as e:
            raise unavailable(where, e) from None

    return engine


def unavailable(url: sa.URL, error: pymysql.err.MySQLError) -> DatabaseUnavailable:
    """``cannot connect to database "forge" on db:3306 as user "app": <the server's reason>``."""
    errno = error.args[0] if error.args and isinstance(error.args[0], int) else None
    reason = str(error.args[1]) if len(error.args) > 1 else type(error).__name__
    reason = reason.splitlines()[0].strip() if reason.strip() else type(error).__name__
    if url.password:
        reason = reason.replace(str(url.password), "***")
    if errno is not None:
        reason = f"{reason} (error {errno})"
    return DatabaseUnavailable(
        f'cannot connect to database "{url.database or "(none)"}" on {url.host or "localhost"}:'
        f'{url.port or DEFAULT_PORT} as user "{url.username or "(default)"}": {reason}',
        retryable=errno not in _PERMANENT_ERRNOS)


def describe_db_error(exc: BaseException | None) -> str:
    """Class name and error number only: a server message may quote row values."""
    if isinstance(exc, pymysql.err.MySQLError):
        errno = exc.args[0] if exc.args and isinstance(exc.args[0], int) else "no number"
        return f"{type(exc).__name__}, error {errno}"
    return type(exc).__name__ if exc is not None else "unknown error"


T = TypeVar("T")


def is_mariadb(conn: MySqlConnection) -> bool:
    """From the version the server sent at connect (``10.11.6-MariaDB-...``): no round trip."""
    return "mariadb" in str(getattr(conn, "server_version", "")).lower()


def error_number(exc: BaseException) -> int | None:
    if isinstance(exc, pymysql.err.MySQLError) and exc.args and isinstance(exc.args[0], int):
        return exc.args[0]
    return None


def probe(conn: MySqlConnection, statement: str, refusals: Mapping[int, T]) -> T | None:
    """Run ``statement`` (a read that returns nothing, as ``SELECT ... LIMIT 0``) to ask the server
    itself what ``information_schema`` may hide: None when it runs; ``refusals[n]`` when the server
    refuses it with error number ``n``; any other error is raised as the driver's."""
    try:
        with conn.cursor() as cur:
            cur.execute(statement, ())
            cur.fetchall()
    except pymysql.err.MySQLError as e:
        number = error_number(e)
        if number is not None and number in refusals:
            return refusals[number]
        raise
    return None


@contextlib.contextmanager
def raw_connection(engine: sa.Engine) -> Iterator[MySqlConnection]:
    """A PyMySQL connection from the pool in autocommit mode (every batch is an explicit
    transaction), handed back rolled back with the session settings pinrotate changes reset."""
    try:
        proxied = engine.raw_connection()  # DatabaseUnavailable when no connection can be had
    except pymysql.err.OperationalError as e:
        # Connected, then lost while SQLAlchemy first read the server (its on-connect statements
        # raise the driver's error as it is): an outage or a killed session, as retryable as a
        # connection that could not be had.
        raise unavailable(engine.url, e) from None
    except sa.exc.DBAPIError as e:  # the same, from the dialect's first reads (version, sql_mode)
        if isinstance(e.orig, pymysql.err.OperationalError):
            raise unavailable(engine.url, e.orig) from None
        raise
    try:
        conn = proxied.driver_connection
        assert isinstance(conn, Connection)
        conn.rollback()
        conn.autocommit(True)
        try:
            yield conn
        finally:
            with contextlib.suppress(pymysql.err.MySQLError):
                if conn.open:
                    conn.rollback()
                    with conn.cursor() as cur:  # guard.batch_limits' variables, whichever were set
                        cur.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")
                        cur.execute("SET SESSION max_statement_time = DEFAULT, idle_transaction_timeout = DEFAULT"
                                    if is_mariadb(conn)
                                    else "SET SESSION max_execution_time = DEFAULT")
                    conn.autocommit(False)
    finally:
        proxied.close()


@dataclass(frozen=True)
class ServerInfo:
    flavour: str  # "mariadb" | "mysql"
    version: tuple[int, int, int]
    version_text: str  # SELECT VERSION()

    @property
    def label(self) -> str:
        return f"{'MariaDB' if self.flavour == 'mariadb' else 'MySQL'} {'.'.join(map(str, self.version))}"


_VERSION = re.compile(r"^(?:5\.5\.5-)?(\d+)\.(\d+)\.(\d+)")


def parse_server_version(version_text: str, version_comment: str = "") -> ServerInfo:
    """``10.11.6-MariaDB-0+deb12u1`` -> MariaDB (10, 11, 6); ``8.0.36`` -> MySQL. ConfigError for a
    server older than MariaDB 10.6 / MySQL 8.0 (no SKIP LOCKED, no INNODB_TRX columns relied on)."""
    flavour = "mariadb" if "mariadb" in f"{version_text} {version_comment}".lower() else "mysql"
    match = _VERSION.match(version_text)
    if match is None:
        raise ConfigError(f"database.url: cannot read the server version ({version_text[:40]!r})")
    version = (int(match[1]), int(match[2]), int(match[3]))
    info = ServerInfo(flavour, version, version_text)
    if version[:2] < MINIMUM[flavour]:
        need = "MariaDB 10.6+" if flavour == "mariadb" else "MySQL 8.0+"
        raise ConfigError(f"database.url: {info.label} is not supported (pinrotate needs {need}: "
                          "SKIP LOCKED and the InnoDB views it relies on)")
    return info


def server_info(conn: MySqlConnection) -> ServerInfo:
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT VERSION(), @@version_comment")
            row = cur.fetchone()
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"cannot read the server version ({describe_db_error(e)})") from None
    assert row is not None
    return parse_server_version(str(row[0]), str(row[1] or ""))


def check_server(engine: sa.Engine) -> ServerInfo:
    """Connect once and refuse a server too old (ConfigError, one line), before anything else."""
    with raw_connection(engine) as conn:
        return server_info(conn)


def database_identity(engine: sa.Engine) -> dict[str, Any]:
    """Which database a report speaks of, as ``db.database_identity`` says it for PostgreSQL:
    the server's own identifier (MySQL ``@@server_uuid``, kept in auto.cnf; MariaDB ``@@server_uid``,
    derived from its host, port and data directory), database, address and version."""
    url = engine.url
    identity: dict[str, Any] = {"system_identifier": None, "database": url.database, "host": url.host or "localhost",
                                "port": url.port or DEFAULT_PORT, "server_version": None}
    with raw_connection(engine) as conn:
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW VARIABLES WHERE Variable_name IN ('server_uuid', 'server_uid', 'port', 'version')")
                found = {str(k): str(v) for k, v in cur.fetchall()}
                cur.execute("SELECT DATABASE()")
                row = cur.fetchone()
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"cannot read the database identity ({describe_db_error(e)})") from None
    identity["system_identifier"] = found.get("server_uuid") or found.get("server_uid")
    identity["server_version"] = found.get("version")
    identity["port"] = int(found.get("port") or identity["port"])
    identity["database"] = str(row[0]) if row and row[0] is not None else identity["database"]
    return identity
