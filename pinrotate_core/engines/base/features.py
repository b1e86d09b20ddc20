"""What an engine can do, asked by the callers instead of its name (Django's ``DatabaseFeatures``),
which engine a database URL names, and a URL fit to print. Nothing here connects."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from ...errors import ConfigError

# URL scheme (SQLAlchemy backend name, before any "+driver") -> engine room.
ENGINE_OF_SCHEME = {"postgresql": "postgresql", "postgres": "postgresql", "mysql": "mysql", "mariadb": "mysql"}


def engine_of_url(url: str) -> str:
    """``postgresql`` or ``mysql`` for a database URL; ConfigError (one line, no URL) otherwise."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    backend = scheme.split("+", 1)[0].lower()
    if backend not in ENGINE_OF_SCHEME:
        raise ConfigError("database.url: not a PostgreSQL, MySQL or MariaDB URL "
                          "(postgresql://, mysql:// or mariadb://)")
    return ENGINE_OF_SCHEME[backend]


def redacted(url: str) -> str:
    """A database URL without its password, to name a server in a message or a report."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "<unparseable URL>"


@dataclass(frozen=True)
class Features:
    """Answers that change which path a caller takes; every field is a fact of the engine."""

    name: str  # "postgresql" | "mysql"
    # Row versions (PostgreSQL's xmin/ctid): the aesgcm / vault-transit guard writes by them. Without
    # them every scheme writes by compare-and-swap on the values read.
    has_row_versions: bool
    # SELECT ... FOR UPDATE SKIP LOCKED (PostgreSQL 9.5+, MySQL 8.0+, MariaDB 10.6+).
    has_skip_locked: bool
    # Row-level security that can hide rows from the role (PostgreSQL policies; MySQL has none).
    has_row_security: bool
    # A session setting that silences ordinary triggers for one transaction
    # (session_replication_role); without it triggers = "disable" is BLOCKED.
    can_silence_triggers: bool
    # Columns the server rewrites on every UPDATE by itself (MySQL's ON UPDATE CURRENT_TIMESTAMP):
    # a write must set them to themselves.
    has_auto_updated_columns: bool
    # A schema is a database of the server (MySQL): the sweep covers every database the role reads.
    schema_is_database: bool
    # Prepared two-phase transactions are visible by database (pg_prepared_xacts) or server-wide
    # only (XA RECOVER).
    prepared_per_database: bool
