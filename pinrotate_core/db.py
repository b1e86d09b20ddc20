"""Database access, whichever the engine: which room a URL belongs to, the URL to use (the embedded
PostgreSQL by default), and ``make_engine`` dispatching to the room. Each room keeps its own
connection pieces (``engines/postgresql/connect.py``, ``engines/mysql/connect.py``). Never logs a
URL's password.
"""

from __future__ import annotations

import sqlalchemy as sa

from .config import Settings, pinrotate_home
from .engines import engine_of_url
from .engines.base.features import redacted
from .engines.postgresql import connect as postgresql_connect

# The PostgreSQL pieces that drain/, throttle/, inventory, rotation, key_checks, conflicts, samples
# and the demos still import from here; each goes when its caller asks the room (docs/engines.md).
from .engines.postgresql.connect import describe_db_error, embedded_server, raw_connection, read_only_when

__all__ = ["database_url", "describe_db_error", "embedded_server", "is_postgresql", "make_engine", "raw_connection",
           "read_only_when", "redacted"]


def database_url(settings: Settings) -> str:
    return settings.database.url or postgresql_connect.embedded_url(pinrotate_home())


def is_postgresql(url: str) -> bool:
    """Which room a URL belongs to; ConfigError (one line, no URL) for a scheme pinrotate does not know."""
    return engine_of_url(url) == "postgresql"


def make_engine(url: str, *, pool_size: int = 5) -> sa.Engine:
    """A pooled engine for ``url`` from its room: PostgreSQL, or MySQL / MariaDB (whose server
    flavour and version are checked once, at the first connection: ``check_server``)."""
    if not is_postgresql(url):
        from .engines.mysql import connect as mysql_connect  # the room imports only base, errors, log

        engine = mysql_connect.make_engine(url, pool_size=pool_size)
        try:
            mysql_connect.check_server(engine)  # unreachable: DatabaseUnavailable (exit 4); too old: exit 2
        except BaseException:
            engine.dispose()
            raise
        return engine
    return postgresql_connect.make_engine(url, pool_size=pool_size)
