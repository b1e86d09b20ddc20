"""Sample data to try pinrotate on: the Pin profile schema and synthetic rows, loaded into a
database the operator names (``python -m flows.rotate seed``) or into the demo's sandbox.

Never real personal data, never a value in a log line. Loading refuses a database that already
holds the sample's tables: it creates them, it never adds to or changes tables that exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ..config import Settings
from ..db import database_url, make_engine
from ..engines.postgresql.connect import describe_db_error, raw_connection
from ..errors import ConfigError, DatabaseError
from ..keyring import Keyring, is_version
from . import forge_sample, pin_profile

SAMPLES = ("pin-profile", "forge")


def seed_database(settings: Settings, keyring: Keyring, *, rows: int, key_id: str | None = None,
                  seed: int | None = None) -> pin_profile.SeedSummary:
    """Create the Pin profile tables in the configured database and load ``rows`` persons (and
    their documents, templates and requests) encrypted under ``key_id`` (default: the current key).

    All or nothing, in one transaction: refused (``ConfigError``, nothing written) when any of the
    sample's tables exists already, when ``key_id`` is not an integer key version the keyring holds.
    """
    if rows < 1:
        raise ConfigError("--rows: must be at least 1")
    key = key_id or keyring.current
    if not is_version(key) or key not in keyring.keys:
        raise ConfigError(f"--key {key}: the Pin profile sample is aesgcm and needs an integer key version that"
                          f" the keyring holds ({', '.join(sorted(keyring.keys))}); nothing was written")
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        with raw_connection(engine) as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('pinrotate:seed', 0))")
            found = _existing_tables(conn)
            if found:
                raise ConfigError(f"database {conn.info.dbname} already holds {found[0]}: seed loads the sample"
                                  " only where its tables do not exist yet; nothing was written")
            pin_profile.apply_pin_profile_schema(conn)
            return pin_profile.seed_pin_profile(conn, keyring, rows=rows, key_id=key, seed=seed)
    except psycopg.Error as e:
        raise DatabaseError(f"cannot seed the sample ({describe_db_error(e)}); nothing was written") from None
    finally:
        engine.dispose()


def _existing_tables(conn: psycopg.Connection[Any]) -> list[str]:
    names = [f"{pin_profile.SCHEMA}.{t}" for t in pin_profile.TABLES]
    query = sql.SQL("SELECT name FROM unnest(%s::text[]) AS name WHERE to_regclass(name) IS NOT NULL ORDER BY 1")
    return [row[0] for row in conn.execute(query, [names]).fetchall()]


def seed_forge_sample(settings: Settings, bootstrap_file: Path, *, rows: int) -> forge_sample.ForgeSeedSummary:
    """Forge's tables (examples/forge.sql) with values as Forge writes them, and a sample Forge
    bootstrap file at ``bootstrap_file`` (written only where none exists) to read them with.

    Refused (``ConfigError``, nothing written) when Forge's tables exist in the configured database
    or a bootstrap file exists at ``bootstrap_file``. All the rows in one transaction.
    """
    if rows < 1:
        raise ConfigError("--rows: must be at least 1")
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        with raw_connection(engine) as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('pinrotate:seed', 0))")
            found = forge_sample.existing_tables(conn)
            if found:
                raise ConfigError(f"database {conn.info.dbname} already holds {found[0]}: seed loads the sample"
                                  " only where its tables do not exist yet; nothing was written")
            keys = forge_sample.write_sample_bootstrap(bootstrap_file)
            try:
                counts = forge_sample.seed_forge(conn, keys, rows)
            except BaseException:
                bootstrap_file.unlink(missing_ok=True)  # ours, written a moment ago: the seed is all or nothing
                raise
            return forge_sample.ForgeSeedSummary(str(bootstrap_file), counts)
    except psycopg.Error as e:
        raise DatabaseError(f"cannot seed the sample ({describe_db_error(e)}); nothing was written") from None
    finally:
        engine.dispose()
