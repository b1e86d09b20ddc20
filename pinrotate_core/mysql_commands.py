"""The commands on a MySQL / MariaDB URL while their wiring is under way (issue 32).

What is wired: the URL is accepted, the server is reached once at start (``db.make_engine``: an
unreachable server is exit 4 with one line naming database, address and user; a server older than
MariaDB 10.6 / MySQL 8.0 is exit 2); ``inventory`` (``mysql_inventory``), ``gate --retire``
(``mysql_gate``), ``run`` (the Prefect flow, whose steps ask ``mysql_run``) and ``grants``
(``mysql_grants``).

What is not wired yet refuses to start (exit 2, one line, nothing read or written): ``seed`` of the
Pin profile and ``inventory --discover``: they would read and write through the PostgreSQL code paths, which must
not be pointed at another server.

The engine room (``engines/mysql``) holds the SQL; this module holds only these decisions.
"""

from __future__ import annotations

from typing import NoReturn

from .config import Settings
from .db import database_url, is_postgresql, make_engine
from .errors import ConfigError

ISSUE = "issue 32"


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
