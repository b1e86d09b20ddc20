"""The commands on a MySQL / MariaDB URL (issue 32): which core module each one goes through.

Every command is wired: the URL is accepted, the server is reached once at start
(``db.make_engine``: an unreachable server is exit 4 with one line naming database, address and
user; a server older than MariaDB 10.6 / MySQL 8.0 is exit 2); ``inventory`` (``mysql_inventory``;
``--discover``: ``mysql_sweep.discover_mysql``), ``gate --retire`` (``mysql_gate``), ``run`` (the
Prefect flow, whose steps ask ``mysql_run``: ``aesgcm``, ``fpc1`` and ``vault-transit``; its gate
section ``mysql_gate.run_gate``), ``grants`` (``mysql_grants``), ``seed`` of both samples
(``mysql_seed``), with pinrotate's own records (key check values, CONFLICTs) in the server's
``pinrotate`` database (``mysql_bookkeeping``). ``keys`` never reads the database.

The engine room (``engines/mysql``) holds the SQL; the ``mysql_*`` modules hold the decisions.
"""

from __future__ import annotations

from .config import Settings
from .db import database_url, is_postgresql, make_engine


def on_mysql(settings: Settings) -> bool:
    """True for a ``mysql://`` or ``mariadb://`` URL (an absent URL is the embedded PostgreSQL)."""
    return settings.database.url is not None and not is_postgresql(settings.database.url)


def reach(settings: Settings) -> None:
    """Connect once and check the server's flavour and version (exit 4 / exit 2, one line)."""
    make_engine(database_url(settings), pool_size=1).dispose()
