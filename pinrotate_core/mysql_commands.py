"""The commands on a MySQL / MariaDB URL while their wiring is under way (issue 32).

What is wired: the URL is accepted, the server is reached once at start (``db.make_engine``: an
unreachable server is exit 4 with one line naming database, address and user; a server older than
MariaDB 10.6 / MySQL 8.0 is exit 2), and ``grants`` prints MySQL's GRANT statements.

What is not wired yet is refused or closed, never guessed:

- ``run`` (also ``--dry-run``), ``seed`` and ``inventory --discover`` refuse to start (exit 2, one line): they
  read and write through the PostgreSQL code paths, which must not be pointed at another server.
- ``gate --retire KEY`` answers **closed** (exit 3) and names, as UNSWEPT, every check it did not
  make on this server: a wrong "open" would let a key be destroyed while values still need it.

The engine room (``engines/mysql``) holds the SQL; this module holds only these decisions.
"""

from __future__ import annotations

from typing import NoReturn

from .config import Settings
from .db import database_url, is_postgresql, make_engine
from .errors import ConfigError
from .gate.discover import Discovery, apply_discovery
from .gate.verdict import GateReport, check_retire_key
from .providers import build_provider

ISSUE = "issue 32"

# Every part of a retire verdict (contract §6) that the gate does not yet make on MySQL / MariaDB.
UNCHECKED_GATE_PARTS = {
    "the configured targets": "inventory of every target on this server not wired yet (MySQL / MariaDB)",
    "the database outside the targets": "sweep of every database the role can read not wired yet "
                                        "(MySQL / MariaDB)",
    "transactions in flight": "INNODB_TRX and prepared XA transactions not checked yet (MySQL / MariaDB)",
    "durability and replicas": "durability settings and replica positions not checked yet (MySQL / MariaDB)",
}


def on_mysql(settings: Settings) -> bool:
    """True for a ``mysql://`` or ``mariadb://`` URL (an absent URL is the embedded PostgreSQL)."""
    return settings.database.url is not None and not is_postgresql(settings.database.url)


def reach(settings: Settings) -> None:
    """Connect once and check the server's flavour and version (exit 4 / exit 2, one line)."""
    make_engine(database_url(settings), pool_size=1).dispose()


def refuse_unwired(settings: Settings, command: str) -> NoReturn:
    """``command`` on MySQL / MariaDB: the server is reached first (so that an unreachable one is
    exit 4, as for every command), then the start is refused with nothing read or written."""
    reach(settings)
    raise ConfigError(f"database.url: {command} on MySQL / MariaDB is not available in this version yet "
                      f"({ISSUE}); nothing was read or written")


def closed_gate(settings: Settings, key: str, *, tenant: str | None = None, deep: bool = True,
                erase_excluded: bool = False) -> GateReport:
    """``gate --retire KEY`` on MySQL / MariaDB: KEY is checked against the keyring as everywhere
    (exit 2 when unknown or current), the server is reached, and the verdict is closed, naming as
    UNSWEPT each part of the verdict not checked on this server. Never open."""
    from .engines.mysql import connect as mysql_connect

    keyring = build_provider(settings).load_keyring()
    check_retire_key(keyring, key)
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        identity = mysql_connect.database_identity(engine)
    finally:
        engine.dispose()
    report = GateReport(key=key, open=False, blocking={}, current_key=keyring.current,
                        erase_excluded=erase_excluded)
    unchecked = Discovery(server_side=keyring.server_side)
    unchecked.unswept.update(UNCHECKED_GATE_PARTS)
    apply_discovery(report, unchecked)
    report.open = False  # whatever apply_discovery counted: nothing here was read
    report.database = identity
    report.keyring_source = keyring.source
    report.scope = {"all_tenants": True, "targets": [t.name for t in settings.targets], "deep": deep,
                    "filter": {"tenant": tenant}, "erase_excluded": erase_excluded, "one_snapshot": False,
                    "not_checked": sorted(UNCHECKED_GATE_PARTS)}
    return report
