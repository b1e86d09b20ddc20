"""``seed --preset forge`` on MySQL / MariaDB: Forge's tables from ``examples/forge-mysql.sql`` with
the rows of the PostgreSQL sample (``samples.forge_sample.sample_rows``: values as Forge writes
them) and a sample Forge bootstrap file. Refused (exit 2, nothing written) where one of Forge's
tables exists in the configured database or a bootstrap file exists.

MySQL commits DDL as it runs it: the tables are created first, then the rows in one transaction;
if anything fails after the tables were created, the tables this command created are dropped and
the bootstrap file it wrote is removed, so that a failed seed leaves nothing behind.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Final

import pymysql

from .config import Settings
from .db import database_url, make_engine
from .engines.mysql import connect as mysql_connect
from .engines.mysql.operations import OPERATIONS as ops
from .errors import ConfigError, DatabaseError
from .samples import forge_sample

SCHEMA_SQL: Final = Path(__file__).resolve().parents[1] / "examples" / "forge-mysql.sql"
SEED_LOCK: Final = "pinrotate:seed"
# Forge's MySQL tables name some columns otherwise and ask for more than the PostgreSQL sample's:
# the same rows, with a connection's driver and the customer's name where Flyway's scripts put them.
DC_INSERT: Final = ("INSERT INTO ai_report_data_connection (id, tenant_id, connection_code, connection_name, jdbc_url,"
                    " username, password_cipher, db_type, driver_class_name)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s, 'MYSQL', 'com.mysql.cj.jdbc.Driver')")
CUSTOMER_INSERT: Final = ("INSERT INTO crm_customer (id, tenant_id, customer_name, phone, id_card)"
                          " VALUES (%s, %s, %s, %s, %s)")


def _statements(text: str) -> list[str]:
    """The file's statements (comments dropped; it holds no ';' inside a literal or comment)."""
    lines = [line.split("--", 1)[0] if line.lstrip().startswith("--") else line for line in text.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def seed_forge_mysql(settings: Settings, bootstrap_file: Path, *, rows: int) -> forge_sample.ForgeSeedSummary:
    if rows < 1:
        raise ConfigError("--rows: must be at least 1")
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        with mysql_connect.raw_connection(engine) as conn, conn.cursor() as cur:
            cur.execute("SELECT GET_LOCK(%s, 10), DATABASE()", (SEED_LOCK,))
            row = cur.fetchone()
            database = str(row[1]) if row else "?"
            marks = ", ".join(["%s"] * len(forge_sample.TABLES))
            cur.execute(f"SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
                        f" AND TABLE_NAME IN ({marks}) ORDER BY 1", forge_sample.TABLES)
            found = [str(r[0]) for r in cur.fetchall()]
            if found:
                raise ConfigError(f"database {database} already holds {found[0]}: seed loads the sample only where"
                                  " its tables do not exist yet; nothing was written")
            keys = forge_sample.write_sample_bootstrap(bootstrap_file)
            try:
                for statement in _statements(SCHEMA_SQL.read_text(encoding="utf-8")):
                    cur.execute(statement)  # no parameters: the text is sent as it is
                sample = forge_sample.sample_rows(keys, rows)
                conn.begin()
                cur.executemany(DC_INSERT, sample.connections)
                cur.execute(forge_sample.CONFIG_INSERT, (sample.encrypt_config,))
                cur.executemany(CUSTOMER_INSERT, sample.customers)
                conn.commit()
            except BaseException:
                conn.rollback()
                bootstrap_file.unlink(missing_ok=True)  # ours, written a moment ago
                with contextlib.suppress(pymysql.err.MySQLError):
                    for table in reversed(forge_sample.TABLES):
                        cur.execute(f"DROP TABLE IF EXISTS {ops.quote(table)}", ())
                raise
            return forge_sample.ForgeSeedSummary(str(bootstrap_file), sample.counts())
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"cannot seed the sample ({mysql_connect.describe_db_error(e)}); nothing was "
                            "written") from None
    finally:
        engine.dispose()
