"""``seed`` on MySQL / MariaDB, both samples, in the URL's database:

- the Pin profile (``seed``): the four tables of ``examples/pin-profile-mysql.sql`` with the rows
  of the PostgreSQL sample (``samples.pin_profile``: the same synthetic plaintexts, ids and audit
  columns, every cipher value ``aesgcm`` raw bytes under the chosen key);
- Forge (``seed --preset forge``): Forge's tables from ``examples/forge-mysql.sql`` with the rows
  of the PostgreSQL sample (``samples.forge_sample.sample_rows``: values as Forge writes them) and
  a sample Forge bootstrap file.

Refused (exit 2, nothing written) where one of the sample's tables exists in the configured
database (or, for Forge, a bootstrap file exists).

MySQL commits DDL as it runs it: the tables are created first, then the rows in one transaction;
if anything fails after the tables were created, the tables this command created are dropped and
the bootstrap file it wrote is removed, so that a failed seed leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import hmac
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pymysql

from ...config import Settings
from ...db import database_url, make_engine
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql.operations import OPERATIONS as ops
from ...errors import ConfigError, DatabaseError
from ...keyring import Keyring, is_version
from ...samples import forge_sample, pin_profile
from ...schemes.aesgcm import AesGcmCipherSet

SCHEMA_SQL: Final = Path(__file__).resolve().parents[3] / "examples" / "forge-mysql.sql"
PIN_SCHEMA_SQL: Final = Path(__file__).resolve().parents[3] / "examples" / "pin-profile-mysql.sql"
INSERT_CHUNK: Final = 500  # rows per multi-row INSERT
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


def _claim_empty_database(cur: Any, tables: Sequence[str]) -> str:
    """Take the seed's lock and refuse, before anything is written, a URL naming no database or a
    database that already holds one of the sample's ``tables`` (a seed never writes over tables).
    Returns the database's name."""
    cur.execute("SELECT GET_LOCK(%s, 10), DATABASE()", (SEED_LOCK,))
    row = cur.fetchone()
    database = str(row[1]) if row and row[1] is not None else None
    if database is None:
        raise ConfigError("database.url: seed loads the sample into the URL's database, and it names none")
    marks = ", ".join(["%s"] * len(tables))
    cur.execute(f"SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
                f" AND TABLE_NAME IN ({marks}) ORDER BY 1", tuple(tables))
    found = [str(r[0]) for r in cur.fetchall()]
    if found:
        raise ConfigError(f"database {database} already holds {found[0]}: seed loads the sample only where"
                          " its tables do not exist yet; nothing was written")
    return database


def seed_forge_mysql(settings: Settings, bootstrap_file: Path, *, rows: int) -> forge_sample.ForgeSeedSummary:
    if rows < 1:
        raise ConfigError("--rows: must be at least 1")
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        with mysql_connect.raw_connection(engine) as conn, conn.cursor() as cur:
            _claim_empty_database(cur, forge_sample.TABLES)
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


# --- the Pin profile -----------------------------------------------------------------------------

_AUDIT = ("version", "updated_at", "updated_by_user_id")
PIN_COLUMNS: Final = {
    pin_profile.PERSONS: ("id", "owner_user_id", *pin_profile.CIPHER_COLUMNS[pin_profile.PERSONS], "key_version",
                          "citizenship_country_id", "gender", *_AUDIT),
    pin_profile.PERSON_DOCUMENTS: ("id", "person_id", "document_type", "payload_cipher", "number_hash", "number_mask",
                                   "key_version", "scan_list", "expires_on", *_AUDIT),
    pin_profile.REQUISITE_TEMPLATES: ("id", "person_id", "name",
                                      *pin_profile.CIPHER_COLUMNS[pin_profile.REQUISITE_TEMPLATES], "key_version",
                                      "composition", *_AUDIT),
    pin_profile.VERIFICATION_REQUESTS: ("id", "person_id", "status", "submitted_at", "snapshot_cipher", "key_version",
                                        *_AUDIT),
}
_EPOCH = dt.datetime(2024, 1, 1)  # pin_profile's audit times, as naive UTC (MySQL's datetime)
_EXPIRY = dt.date(2030, 1, 1)
_COUNTRIES = (643, 398, 112, 51)
_COMPOSITIONS = ('{"fields":[]}', '{"fields":["email"]}', '{"fields":["email","phone"]}')


def _uuid(raw: bytes) -> str:
    return str(uuid.UUID(bytes=raw[:16]))


def _id(seed: int, table: str, n: int) -> str:
    return str(pin_profile.row_id(seed, table, n))


def pin_rows(keyring: Keyring, key_id: str, seed: int, rows: int) -> dict[str, Iterator[tuple[Any, ...]]]:
    """The PostgreSQL sample's rows (``pin_profile.seed_pin_profile``) as MySQL parameter tuples,
    per table, in ``PIN_COLUMNS`` order: the same ids, plaintexts and audit columns."""
    encrypt_with = AesGcmCipherSet(keyring).cipher(key_id).encrypt  # KeyUnavailable when the keyring lacks it
    kv = int(key_id)
    hash_key = hashlib.sha256(f"pinrotate-preset-number-hash:{seed}".encode()).digest()
    ranges = {t: range(pin_profile.table_row_count(t, rows)) for t in pin_profile.TABLES}
    digest = pin_profile._digest

    def encrypt(plaintext: bytes | None) -> bytes | None:
        return None if plaintext is None else encrypt_with(plaintext, os.urandom(12))

    def audit(n: int, d: bytes) -> tuple[Any, ...]:
        return 1 + n % 5, _EPOCH + dt.timedelta(minutes=n), _uuid(d[48:64])

    def persons() -> Iterator[tuple[Any, ...]]:
        for n in ranges[pin_profile.PERSONS]:
            d = digest(seed, pin_profile.PERSONS, n)
            p = pin_profile.person_plaintexts(seed, n, d)
            yield (_id(seed, pin_profile.PERSONS, n), _uuid(d[16:32]),
                   *(encrypt(p[c]) for c in pin_profile.CIPHER_COLUMNS[pin_profile.PERSONS]),
                   kv, _COUNTRIES[n % 4], ("F", "M")[n % 2], *audit(n, d))

    def documents() -> Iterator[tuple[Any, ...]]:
        for n in ranges[pin_profile.PERSON_DOCUMENTS]:
            d = digest(seed, pin_profile.PERSON_DOCUMENTS, n)
            number = f"{int.from_bytes(d[36:44], 'big') % 10**10:010d}"
            scans = [f"scan-{n:06d}-{i}.jpg" for i in range(n % 3)]
            yield (_id(seed, pin_profile.PERSON_DOCUMENTS, n), _id(seed, pin_profile.PERSONS, n),
                   ("passport", "snils", "inn")[n % 3],
                   encrypt(pin_profile.document_plaintexts(seed, n, d)["payload_cipher"]),
                   hmac.digest(hash_key, number.encode(), "sha256"), "******" + number[-4:], kv,
                   "[" + ",".join(f'"{s}"' for s in scans) + "]", _EXPIRY + dt.timedelta(days=n % 3650),
                   *audit(n, d))

    def templates() -> Iterator[tuple[Any, ...]]:
        for n in ranges[pin_profile.REQUISITE_TEMPLATES]:
            d = digest(seed, pin_profile.REQUISITE_TEMPLATES, n)
            p = pin_profile.template_plaintexts(seed, n, d)
            yield (_id(seed, pin_profile.REQUISITE_TEMPLATES, n), _id(seed, pin_profile.PERSONS, n), f"Template {n}",
                   *(encrypt(p[c]) for c in pin_profile.CIPHER_COLUMNS[pin_profile.REQUISITE_TEMPLATES]),
                   kv, _COMPOSITIONS[n % 3], *audit(n, d))

    def requests() -> Iterator[tuple[Any, ...]]:
        for n in ranges[pin_profile.VERIFICATION_REQUESTS]:
            d = digest(seed, pin_profile.VERIFICATION_REQUESTS, n)
            draft = pin_profile.is_draft(n)
            yield (_id(seed, pin_profile.VERIFICATION_REQUESTS, n), _id(seed, pin_profile.PERSONS, n),
                   "draft" if draft else "submitted",
                   None if draft else _EPOCH + dt.timedelta(minutes=n, seconds=30),
                   encrypt(pin_profile.request_plaintexts(seed, n, d)["snapshot_cipher"]),
                   None if draft else kv, *audit(n, d))

    makers: dict[str, Callable[[], Iterator[tuple[Any, ...]]]] = {
        pin_profile.PERSONS: persons, pin_profile.PERSON_DOCUMENTS: documents,
        pin_profile.REQUISITE_TEMPLATES: templates, pin_profile.VERIFICATION_REQUESTS: requests}
    return {t: make() for t, make in makers.items()}


def _chunks(rows: Iterator[tuple[Any, ...]], size: int) -> Iterator[list[tuple[Any, ...]]]:
    chunk: list[tuple[Any, ...]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _insert(table: str, columns: Sequence[str]) -> str:
    return (f"INSERT INTO {ops.quote(table)} ({', '.join(map(ops.quote, columns))})"
            f" VALUES ({', '.join(['%s'] * len(columns))})")


def seed_pin_profile_mysql(settings: Settings, keyring: Keyring, *, rows: int, key_id: str | None = None,
                           seed: int | None = None) -> pin_profile.SeedSummary:
    """``seed`` of the Pin profile into the URL's database (``samples.seed_database`` on MySQL):
    the tables are created first (MySQL commits DDL as it runs it), then every row in one
    transaction; if anything fails after the tables were created, they are dropped again."""
    if rows < 1:
        raise ConfigError("--rows: must be at least 1")
    key = key_id or keyring.current
    if not is_version(key) or key not in keyring.keys:
        raise ConfigError(f"--key {key}: the Pin profile sample is aesgcm and needs an integer key version that"
                          f" the keyring holds ({', '.join(sorted(keyring.keys))}); nothing was written")
    seed = int.from_bytes(os.urandom(8), "big") >> 1 if seed is None else seed
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        with mysql_connect.raw_connection(engine) as conn, conn.cursor() as cur:
            database = _claim_empty_database(cur, pin_profile.TABLES)
            made = pin_rows(keyring, key, seed, rows)  # the key is checked before any table is made
            try:
                for statement in _statements(PIN_SCHEMA_SQL.read_text(encoding="utf-8")):
                    cur.execute(statement)  # no parameters: the text is sent as it is
                conn.begin()
                for table in pin_profile.TABLES:
                    for chunk in _chunks(made[table], INSERT_CHUNK):
                        cur.executemany(_insert(table, PIN_COLUMNS[table]), chunk)
                conn.commit()
            except BaseException:
                conn.rollback()
                with contextlib.suppress(pymysql.err.MySQLError):
                    for table in reversed(pin_profile.TABLES):
                        cur.execute(f"DROP TABLE IF EXISTS {ops.quote(table)}", ())
                raise
            counts = {t: pin_profile.table_row_count(t, rows) for t in pin_profile.TABLES}
            return MySqlSeedSummary(
                seed=seed, key_id=key, first_row=0, persons=counts[pin_profile.PERSONS],
                person_documents=counts[pin_profile.PERSON_DOCUMENTS],
                requisite_templates=counts[pin_profile.REQUISITE_TEMPLATES],
                verification_requests=counts[pin_profile.VERIFICATION_REQUESTS],
                drafts=sum(1 for n in range(counts[pin_profile.VERIFICATION_REQUESTS]) if pin_profile.is_draft(n)),
                database=database)
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"cannot seed the sample ({mysql_connect.describe_db_error(e)}); nothing was "
                            "written") from None
    finally:
        engine.dispose()


@dataclass(frozen=True)
class MySqlSeedSummary(pin_profile.SeedSummary):
    """The Pin profile seeded on MySQL: its tables are in the URL's database, not a ``profile`` schema."""

    database: str = ""

    @property
    def counts(self) -> dict[str, int]:
        return {f"{self.database}.{name.split('.', 1)[1]}": n for name, n in super().counts.items()}
