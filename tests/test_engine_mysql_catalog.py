"""The MySQL room's connections and catalog, on the real MariaDB (tests/mariadb_server.py)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import pymysql
import pytest
import sqlalchemy as sa

from pinrotate_core.engines import engine_of_url
from pinrotate_core.engines.mysql.catalog import CATALOG, read_only_reasons
from pinrotate_core.engines.mysql.connect import (
    MySqlConnection,
    check_server,
    database_identity,
    make_engine,
    parse_server_version,
    raw_connection,
    sqlalchemy_url,
)
from pinrotate_core.errors import ConfigError, DatabaseUnavailable
from tests.mariadb_server import MariaDbServer, free_port


def run(conn: MySqlConnection, *statements: str) -> None:
    with conn.cursor() as cur:
        for s in statements:
            cur.execute(s)


@pytest.mark.parametrize("url", ["mysql://app@db:3306/forge", "mariadb://app:pw@db/forge",
                                 "mysql+mysqldb://app@db/forge"])
def test_mysql_and_mariadb_urls_become_pymysql_urls_in_utf8mb4(url: str) -> None:
    parsed = sqlalchemy_url(url)
    assert parsed.drivername == "mysql+pymysql"
    assert parsed.database == "forge" and parsed.query["charset"] == "utf8mb4"
    assert engine_of_url(url) == "mysql"


def test_a_url_of_another_engine_or_without_database_is_one_clear_line() -> None:
    with pytest.raises(ConfigError, match="not a MySQL or MariaDB URL"):
        sqlalchemy_url("postgresql://app@db/profile")
    with pytest.raises(ConfigError, match="names its database"):
        sqlalchemy_url("mysql://app@db:3306")
    with pytest.raises(ConfigError, match="not a PostgreSQL, MySQL or MariaDB URL"):
        engine_of_url("sqlite:///x.db")
    assert engine_of_url("postgresql://app@db/profile") == "postgresql"


@pytest.mark.parametrize(("text", "comment", "label"), [
    ("10.11.19-MariaDB-0+deb12u1", "Debian 12", "MariaDB 10.11.19"),
    ("10.6.16-MariaDB", "", "MariaDB 10.6.16"),
    ("5.5.5-10.6.16-MariaDB", "", "MariaDB 10.6.16"),
    ("11.4.2-MariaDB-ubu2404", "", "MariaDB 11.4.2"),
    ("8.0.36", "MySQL Community Server - GPL", "MySQL 8.0.36"),
    ("8.4.0-commercial", "MySQL Enterprise Server", "MySQL 8.4.0"),
])
def test_supported_server_versions_are_recognised_by_flavour(text: str, comment: str, label: str) -> None:
    assert parse_server_version(text, comment).label == label


@pytest.mark.parametrize(("text", "named"), [("10.5.23-MariaDB", "MariaDB 10.5.23 is not supported"),
                                              ("5.7.44-log", "MySQL 5.7.44 is not supported")])
def test_an_older_server_is_refused_in_one_line(text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named) as e:
        parse_server_version(text)
    assert "\n" not in str(e.value)


def test_the_test_server_is_detected_as_a_supported_mariadb(mysql_engine: sa.Engine) -> None:
    info = check_server(mysql_engine)
    assert info.flavour == "mariadb" and info.version >= (10, 6, 0)


def test_an_unreachable_server_is_one_line_without_the_password() -> None:
    engine = make_engine(f"mysql://app:s3cret-pw@127.0.0.1:{free_port()}/forge")
    with pytest.raises(DatabaseUnavailable) as e:
        check_server(engine)
    message = str(e.value)
    assert message.startswith('cannot connect to database "forge" on 127.0.0.1:')
    assert 'as user "app"' in message and "s3cret-pw" not in message and "\n" not in message
    assert e.value.retryable


def test_a_wrong_password_is_permanent(mariadb: MariaDbServer, mysql_database: str) -> None:
    engine = make_engine(f"mysql://pinrotate_nobody:wrong-pw@{mariadb.host}:{mariadb.port}/{mysql_database}")
    with pytest.raises(DatabaseUnavailable, match="error 1045") as e:
        check_server(engine)
    assert not e.value.retryable and "wrong-pw" not in str(e.value)


FORGE_LIKE = """
CREATE TABLE ai_report_data_connection (
  id BIGINT NOT NULL PRIMARY KEY,
  password_cipher VARCHAR(512),
  key_version INT NOT NULL DEFAULT 1,
  blob_cipher VARBINARY(300),
  config JSON,
  upper_name VARCHAR(64) AS (UPPER(password_cipher)) VIRTUAL,
  update_time DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP,
  created TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP
)"""


def test_catalog_reads_types_lengths_key_generated_and_auto_updated_columns(my_conn: MySqlConnection) -> None:
    run(my_conn, FORGE_LIKE)
    table = CATALOG.read_table(my_conn, None, "ai_report_data_connection")
    assert table is not None
    cols = table.columns
    assert table.primary_key == ("id",)
    assert (cols["password_cipher"].type_name, cols["password_cipher"].char_length) == ("varchar", 512)
    assert cols["blob_cipher"].type_name == "varbinary" and cols["blob_cipher"].char_length is None
    assert cols["id"].type_name == "bigint"
    # MariaDB keeps JSON as LONGTEXT (with a json_valid CHECK); MySQL 8 has a JSON type.
    assert cols["config"].type_name in ("longtext", "json")
    assert cols["upper_name"].generated and not cols["password_cipher"].generated
    assert [c.name for c in table.auto_updated] == ["update_time"]
    assert not table.update_triggers and not table.missing_privileges and not table.read_only


def test_catalog_of_a_missing_table_is_none_and_a_composite_key_is_reported(my_conn: MySqlConnection) -> None:
    assert CATALOG.read_table(my_conn, None, "nope") is None
    run(my_conn, "CREATE TABLE pair (a INT, b INT, c TEXT, PRIMARY KEY (a, b))")
    table = CATALOG.read_table(my_conn, None, "pair")
    assert table is not None and table.primary_key == ("a", "b")


def test_catalog_lists_update_triggers_only(my_conn: MySqlConnection) -> None:
    run(my_conn, "CREATE TABLE t (id INT PRIMARY KEY, c TEXT, audit INT DEFAULT 0)",
        "CREATE TRIGGER t_ins BEFORE INSERT ON t FOR EACH ROW SET NEW.audit = 1",
        "CREATE TRIGGER t_upd BEFORE UPDATE ON t FOR EACH ROW SET NEW.audit = OLD.audit + 1")
    table = CATALOG.read_table(my_conn, None, "t")
    assert table is not None
    assert [(t.name, t.timing) for t in table.update_triggers] == [("t_upd", "BEFORE")]


@contextlib.contextmanager
def limited_user(mariadb: MariaDbServer, grants: list[str]) -> Iterator[str]:
    """A user of its own (dropped at the end) with exactly ``grants`` ({user} filled in)."""
    user = f"pinrotate_t_{secrets.token_hex(4)}"
    admin = mariadb.connect()
    try:
        run(admin, f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw-{user}'",
            *[g.format(user=f"'{user}'@'%'") for g in grants])
        yield user
    finally:
        with contextlib.suppress(pymysql.Error):
            run(admin, f"DROP USER '{user}'@'%'")
        admin.close()


def test_privileges_are_checked_column_by_column_as_the_server_decides(
        mariadb: MariaDbServer, mysql_database: str, my_conn: MySqlConnection) -> None:
    run(my_conn, "CREATE TABLE t (id INT PRIMARY KEY, c TEXT, kv INT, other TEXT)")
    grants = [f"GRANT SELECT (id, c), UPDATE (c) ON `{mysql_database}`.t TO {{user}}"]
    with limited_user(mariadb, grants) as user:
        engine = make_engine(f"mysql://{user}:pw-{user}@{mariadb.host}:{mariadb.port}/{mysql_database}")
        try:
            with raw_connection(engine) as conn:
                table = CATALOG.read_table(conn, mysql_database, "t", select=["id", "c", "kv"], update=["c", "kv"])
        finally:
            engine.dispose()
    assert table is not None
    assert table.missing_privileges == (("SELECT", "kv"), ("UPDATE", "kv"))
    assert table.role.startswith(f"{user}@")


def test_a_database_wide_grant_is_enough(mariadb: MariaDbServer, mysql_database: str,
                                         my_conn: MySqlConnection) -> None:
    run(my_conn, "CREATE TABLE t (id INT PRIMARY KEY, c TEXT)")
    with limited_user(mariadb, [f"GRANT SELECT, UPDATE ON `{mysql_database}`.* TO {{user}}"]) as user:
        engine = make_engine(f"mysql://{user}:pw-{user}@{mariadb.host}:{mariadb.port}/{mysql_database}")
        try:
            with raw_connection(engine) as conn:
                table = CATALOG.read_table(conn, None, "t", select=["id", "c"], update=["c"])
        finally:
            engine.dispose()
    assert table is not None and table.missing_privileges == ()


def test_a_session_set_read_only_is_detected(my_conn: MySqlConnection) -> None:
    assert read_only_reasons(my_conn) == ()
    run(my_conn, "SET SESSION TRANSACTION READ ONLY")
    try:
        reasons = read_only_reasons(my_conn)
    finally:
        run(my_conn, "SET SESSION TRANSACTION READ WRITE")
    # MariaDB before 11.1 names it tx_read_only, MySQL 8 transaction_read_only.
    assert any(r.startswith(("@@tx_read_only", "@@transaction_read_only")) for r in reasons)


def test_the_database_identity_names_the_server_and_database_without_secrets(
        mariadb: MariaDbServer, mysql_database: str, mysql_engine: sa.Engine) -> None:
    identity = database_identity(mysql_engine)
    assert identity["database"] == mysql_database and identity["port"] == mariadb.port
    assert identity["system_identifier"]  # MariaDB's @@server_uid (MySQL: @@server_uuid)
    assert "MariaDB" in identity["server_version"]
