"""A Forge installation's data, rotated as Forge's own rules say (issue 30). TEST KEYS ONLY.

Every value here is made the way Forge's encryptors make them (hutool's SmUtil.sm4 / SecureUtil.aes:
ECB, PKCS#5/7, base64 of the UTF-8 bytes), by this file's own ECB code (``cryptography`` directly,
never pinrotate's encoder), and every value pinrotate writes is read back the same independent way,
with Forge's header rules. On real PostgreSQL, through the ``forge`` key provider (Forge's own
bootstrap properties file). Each test's body takes the database as a ``ForgeTables`` (here
PostgreSQL's), so that tests/test_forge_rules_mysql.py runs the very same assertions on MariaDB.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import psycopg
import pytest
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.drain import DrainResult

ACTIVE_1, ACTIVE_2 = secrets.token_bytes(16), secrets.token_bytes(16)
LEGACY_KEY = secrets.token_bytes(16)
TRANSPORT_KEY = secrets.token_bytes(16)


# --- Forge's encryptor and reader, written here --------------------------------------------------

def _block(algorithm: str, key: bytes) -> Cipher[modes.ECB]:
    return Cipher(algorithms.SM4(key) if algorithm == "SM4" else algorithms.AES(key), modes.ECB())


def forge_encrypt(algorithm: str, key: bytes, text: str) -> str:
    padder = padding.PKCS7(128).padder()
    enc = _block(algorithm, key).encryptor()
    raw = enc.update(padder.update(text.encode()) + padder.finalize()) + enc.finalize()
    return base64.b64encode(raw).decode()


def forge_decrypt(algorithm: str, key: bytes, payload: str) -> str:
    dec = _block(algorithm, key).decryptor()
    padded = dec.update(base64.b64decode(payload, validate=True)) + dec.finalize()
    unpadder = padding.PKCS7(128).unpadder()
    return (unpadder.update(padded) + unpadder.finalize()).decode()


def forge_reads(stored: str, keys: dict[str, bytes]) -> tuple[str, str, str]:
    """(algorithm, key id, plaintext) as Forge's PersistentCryptoService reads an FPC1 value."""
    parts = stored.split(":", 3)
    assert len(parts) == 4 and parts[0] == "FPC1" and parts[1] in ("SM4", "AES"), "Forge would call it UNKNOWN"
    return parts[1], parts[2], forge_decrypt(parts[1], keys[parts[2]], parts[3])


# --- the installation ---------------------------------------------------------------------------

def bootstrap(path: Path, *, legacy: bytes | None, transport: bytes | None = None) -> Path:
    lines = ["forge.crypto.persistence.enabled=true", "forge.crypto.persistence.write-versioned=true",
             "forge.crypto.persistence.legacy-read-enabled=true", "forge.crypto.persistence.active-key-id=k2",
             f"forge.crypto.persistence.active-key={base64.b64encode(ACTIVE_2).decode()}",
             f"forge.crypto.persistence.keys.k1={base64.b64encode(ACTIVE_1).decode()}"]
    if legacy is not None:
        lines.append(f"forge.crypto.persistence.legacy-key={base64.b64encode(legacy).decode()}")
    if transport is not None:
        lines.append(f"forge.crypto.secret-key={base64.b64encode(transport).decode()}")
    path.write_text("\n".join(lines) + "\n", encoding="latin-1")
    path.chmod(0o600)
    return path


def settings(database_url: str, bootstrap_file: Path) -> Settings:
    return settings_from_mapping({
        "database": {"url": database_url},
        "keys": {"provider": "forge", "file": str(bootstrap_file)},
        "job": {"batch_size": 3, "inter_batch_delay": 0},
        "targets": [{"name": "DataConnection", "table": "ai_report_data_connection", "columns": ["password_cipher"],
                     "format": "fpc1", "tenant": "tenant_id", "soft_delete": "del_flag"},
                    {"name": "lowcode:crm_customer", "table": "crm_customer", "columns": ["phone", "id_card"],
                     "format": "fpc1", "tenant": "tenant_id", "soft_delete": "del_flag",
                     "legacy_algorithm": {"phone": "SM4", "id_card": "AES"}}],
    }, env={})


TABLES = (
    ("CREATE TABLE ai_report_data_connection (id bigint PRIMARY KEY, tenant_id bigint NOT NULL DEFAULT 1,"
     " connection_code varchar(64), password_cipher varchar(500), del_flag char(1) NOT NULL DEFAULT '0')"),
    ("CREATE TABLE crm_customer (id bigint PRIMARY KEY, tenant_id bigint NOT NULL DEFAULT 1,"
     " name varchar(64), phone varchar(255), id_card varchar(255), del_flag char(1) NOT NULL DEFAULT '0')"),
)

# Called with the batch number and the ids of the batch: the drain's before_write hook, after the
# batch's read and before its write, on both engines.
BatchHook = Callable[[int, Sequence[Any]], None]


class ForgeTables(Protocol):
    """Forge's two tables in a fresh database of one engine: its URL, statements with ``%s``
    parameters (the same on both drivers), a column read back, and a drain of the first target."""

    url: str

    def execute(self, statement: str, params: Sequence[Any] = ()) -> None: ...

    def column(self, table: str, name: str) -> dict[int, str | None]: ...

    def drain_first_target(self, s: Settings, after_batch: BatchHook) -> DrainResult: ...


class PgForgeTables:
    def __init__(self, url: str, conn: psycopg.Connection[Any]) -> None:
        self.url, self.conn = url, conn

    def execute(self, statement: str, params: Sequence[Any] = ()) -> None:
        self.conn.execute(statement, params)

    def column(self, table: str, name: str) -> dict[int, str | None]:
        return dict(self.conn.execute(f"SELECT id, {name} FROM {table} ORDER BY id").fetchall())

    def drain_first_target(self, s: Settings, after_batch: BatchHook) -> DrainResult:
        from pinrotate_core.db import make_engine
        from pinrotate_core.drain import DrainOptions, drain_target
        from pinrotate_core.providers import build_provider
        from pinrotate_core.schemes.registry import build_scheme
        from pinrotate_core.targets import resolve_target

        keyring = build_provider(s).load_keyring()
        engine = make_engine(self.url)
        try:
            with psycopg.connect(self.url) as conn:
                target = resolve_target(conn, s.targets[0])
            # Forge's own legacy-read-enabled decides, as rotation applies it.
            scheme = build_scheme(target, keyring, s.keys.model_copy(update={"legacy_read_enabled": True}))
            return drain_target(engine, scheme, DrainOptions(batch_size=3, before_write=after_batch))
        finally:
            engine.dispose()


@pytest.fixture
def forge_tables(database_url: str, pg_conn: psycopg.Connection[Any]) -> Iterator[ForgeTables]:
    yield PgForgeTables(database_url, pg_conn)


def create_tables(db: ForgeTables) -> None:
    for statement in TABLES:
        db.execute(statement)


# --- the tests ----------------------------------------------------------------------------------

def test_forge_values_are_counted_as_forge_counts_them_and_rotated_to_what_forge_reads(
        forge_tables: ForgeTables, tmp_path: Path) -> None:
    create_tables(forge_tables)
    plain = {i: f"jdbc-pass-{i}-口令" for i in range(1, 10)}
    dc = {
        1: forge_encrypt("SM4", LEGACY_KEY, plain[1]),                      # legacy, Forge's default SM4
        2: forge_encrypt("SM4", LEGACY_KEY, plain[2]),
        3: "FPC1:SM4:k1:" + forge_encrypt("SM4", ACTIVE_1, plain[3]),     # historical
        4: "FPC1:aes:k1:" + forge_encrypt("AES", ACTIVE_1, plain[4]),     # historical, code in lower case
        5: "FPC1:SM4:k2:" + forge_encrypt("SM4", ACTIVE_2, plain[5]),     # active
        6: "FPC1:AES-GCM:k1:" + forge_encrypt("AES", ACTIVE_1, plain[6]), # another algorithm: UNKNOWN
        7: "FPC1:SM4:k.1:" + forge_encrypt("SM4", ACTIVE_1, plain[7]),    # illegal key id: UNKNOWN
        8: "FPC1:SM4:k9:" + forge_encrypt("SM4", ACTIVE_1, plain[8]),     # a key Forge lacks: UNKNOWN_KEY
        9: "FPC1:SM4:k1:",                                                 # empty payload: UNKNOWN
        10: "   ",                                                         # blank: no ciphertext
        11: None,
        12: "a plaintext an old Forge left",                               # Forge cannot read it: UNKNOWN
    }
    for i, v in dc.items():
        forge_tables.execute("INSERT INTO ai_report_data_connection (id, connection_code, password_cipher)"
                             " VALUES (%s, %s, %s)", (i, f"c{i}", v))
    crm = {1: (forge_encrypt("SM4", LEGACY_KEY, "13800000000"), forge_encrypt("AES", LEGACY_KEY, "110101199001011234")),
           2: ("FPC1:SM4:k1:" + forge_encrypt("SM4", ACTIVE_1, "13900000000"), None)}
    for i, (phone, id_card) in crm.items():
        forge_tables.execute("INSERT INTO crm_customer (id, name, phone, id_card) VALUES (%s, 'n', %s, %s)",
                             (i, phone, id_card))
    s = settings(forge_tables.url, bootstrap(tmp_path / "crypto.properties", legacy=LEGACY_KEY))

    inv = rotation.inventory(s, deep=True).targets
    counts = {c: inv["DataConnection"].counts[c] for c in ("ACTIVE", "HISTORICAL", "LEGACY", "UNKNOWN", "UNKNOWN_KEY",
                                                           "FAILED")}
    assert counts == {"ACTIVE": 1, "HISTORICAL": 2, "LEGACY": 2, "UNKNOWN": 4, "UNKNOWN_KEY": 1, "FAILED": 0}
    assert inv["lowcode:crm_customer"].counts["LEGACY"] == 2 and inv["lowcode:crm_customer"].counts["HISTORICAL"] == 1

    report = rotation.run_rotation(s, expected_key="k2")

    assert report.targets["DataConnection"].reencrypted == 4
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED  # the UNKNOWN_KEY value is a failed row
    after = forge_tables.column("ai_report_data_connection", "password_cipher")
    keys = {"k1": ACTIVE_1, "k2": ACTIVE_2}
    # Exactly what Forge's reencrypt writes: its own algorithm (a legacy value: the column's), upper case.
    for i, algorithm in ((1, "SM4"), (2, "SM4"), (3, "SM4"), (4, "AES")):
        value = after[i]
        assert value is not None
        assert forge_reads(value, keys) == (algorithm, "k2", plain[i])
        assert value == f"FPC1:{algorithm}:k2:" + forge_encrypt(algorithm, ACTIVE_2, plain[i])
    for i in (5, 6, 7, 8, 9, 10, 11, 12):  # active, UNKNOWN, UNKNOWN_KEY, blank, NULL: untouched
        assert after[i] == dc[i]
    phones = forge_tables.column("crm_customer", "phone")
    id_cards = forge_tables.column("crm_customer", "id_card")
    assert forge_reads(str(phones[1]), keys) == ("SM4", "k2", "13800000000")
    assert forge_reads(str(id_cards[1]), keys) == ("AES", "k2", "110101199001011234")
    assert forge_reads(str(phones[2]), keys) == ("SM4", "k2", "13900000000") and id_cards[2] is None


def test_legacy_values_are_read_with_the_transport_key_when_no_legacy_key_is_set(
        forge_tables: ForgeTables, tmp_path: Path) -> None:
    create_tables(forge_tables)
    forge_tables.execute("INSERT INTO ai_report_data_connection (id, password_cipher) VALUES (1, %s), (2, %s)",
                    (forge_encrypt("SM4", TRANSPORT_KEY, "pw-1"), forge_encrypt("SM4", TRANSPORT_KEY, "pw-2")))
    s = settings(forge_tables.url, bootstrap(tmp_path / "crypto.properties", legacy=None, transport=TRANSPORT_KEY))
    report = rotation.run_rotation(s, expected_key="k2")
    assert report.exit_code == 0 and report.targets["DataConnection"].reencrypted == 2
    after = forge_tables.column("ai_report_data_connection", "password_cipher")
    assert forge_reads(str(after[1]), {"k2": ACTIVE_2}) == ("SM4", "k2", "pw-1")
    assert forge_reads(str(after[2]), {"k2": ACTIVE_2}) == ("SM4", "k2", "pw-2")


def _unpads_under(algorithm: str, key: bytes, payload: str) -> bool:
    """Does the padding alone pass (what Forge's hutool checks)?"""
    dec = _block(algorithm, key).decryptor()
    padded = dec.update(base64.b64decode(payload)) + dec.finalize()
    unpadder = padding.PKCS7(128).unpadder()
    try:
        unpadder.update(padded) + unpadder.finalize()
        return True
    except ValueError:
        return False


def _reads_as_text_under(algorithm: str, key: bytes, payload: str) -> bool:
    try:
        forge_decrypt(algorithm, key, payload)
        return True
    except (ValueError, UnicodeDecodeError):
        return False


def _value_that_happens_to_unpad(written_with: bytes, read_with: bytes) -> str:
    """A legacy value written under one key whose padding also passes under another key: a value
    Forge's reader would turn into garbage under a wrong key (about one try in 256)."""
    for i in range(200_000):
        payload = forge_encrypt("SM4", written_with, f"v{i}")
        if _unpads_under("SM4", read_with, payload):
            return payload
    raise AssertionError("no such value found")


def test_a_wrong_legacy_key_rewrites_nothing_not_even_values_that_happen_to_unpad(
        forge_tables: ForgeTables, tmp_path: Path) -> None:
    create_tables(forge_tables)
    wrong = secrets.token_bytes(16)
    lucky = _value_that_happens_to_unpad(LEGACY_KEY, wrong)
    legacy = [forge_encrypt("SM4", LEGACY_KEY, f"pw-{i}") for i in range(6)]
    values = [lucky, *legacy]
    historical = "FPC1:SM4:k1:" + forge_encrypt("SM4", ACTIVE_1, "pw-h")
    for i, v in enumerate([*values, historical], start=1):
        forge_tables.execute("INSERT INTO ai_report_data_connection (id, password_cipher) VALUES (%s, %s)", (i, v))
    s = settings(forge_tables.url, bootstrap(tmp_path / "crypto.properties", legacy=wrong))
    before = forge_tables.column("ai_report_data_connection", "password_cipher")

    dry = rotation.run_rotation(s, dry_run=True)
    report = rotation.run_rotation(s, expected_key="k2")

    after = forge_tables.column("ai_report_data_connection", "password_cipher")
    assert {i: after[i] for i in range(1, len(values) + 1)} == {i: before[i] for i in range(1, len(values) + 1)}
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED and dry.exit_code == rotation.EXIT_FAIL_CLOSED
    failed = report.targets["DataConnection"].failed
    failing = [i for i, v in enumerate(values, start=1) if not _reads_as_text_under("SM4", wrong, v)]
    assert failing and sorted(int(f.id) for f in failed) == failing  # every value that fails is listed
    # Another key's values of the same target go on.
    assert forge_reads(str(after[len(values) + 1]), {"k2": ACTIVE_2}) == ("SM4", "k2", "pw-h")
    assert report.targets["DataConnection"].reencrypted == 1 == dry.targets["DataConnection"].reencrypted


def test_a_value_written_under_a_checked_key_after_the_pre_pass_holds_the_key_from_that_batch_on(
        forge_tables: ForgeTables, tmp_path: Path) -> None:
    """The pre-pass passed every legacy value; a batch then meets one that fails (written since):
    from that batch on no legacy value is written, and the run ends fail-closed."""
    create_tables(forge_tables)
    for i in range(1, 10):
        forge_tables.execute("INSERT INTO ai_report_data_connection (id, password_cipher) VALUES (%s, %s)",
                             (i, forge_encrypt("SM4", LEGACY_KEY, f"pw-{i}")))
    s = settings(forge_tables.url, bootstrap(tmp_path / "crypto.properties", legacy=LEGACY_KEY))
    foreign = forge_encrypt("SM4", secrets.token_bytes(16), "written under another key")
    while _unpads_under("SM4", LEGACY_KEY, foreign):
        foreign = forge_encrypt("SM4", secrets.token_bytes(16), "written under another key")

    def after_batch(batch: int, ids: Any) -> None:
        if batch == 1:  # after the pre-pass and the first batch's read: a bad value appears further on
            forge_tables.execute("UPDATE ai_report_data_connection SET password_cipher = %s WHERE id = 8", (foreign,))

    result = forge_tables.drain_first_target(s, after_batch)
    after = forge_tables.column("ai_report_data_connection", "password_cipher")
    moved = [i for i in range(1, 10) if str(after[i]).startswith("FPC1:SM4:k2:")]
    # Batches before the one that met the bad value moved; that batch (7, 8, 9) wrote nothing under the key.
    assert moved == [1, 2, 3, 4, 5, 6]
    assert after[7] == forge_encrypt("SM4", LEGACY_KEY, "pw-7") and after[9] == forge_encrypt("SM4", LEGACY_KEY, "pw-9")
    assert [f.id for f in result.failed] == ["8"] and result.fail_closed


# Found once, offline, by trying "pw-%012d" under the first key until one read as text under the
# second (tests/test_forge_rules.py's own ECB code): a legacy value that a wrong legacy key turns
# into valid padding AND valid UTF-8, i.e. into plausible garbage. TEST KEYS ONLY.
FIXED_LEGACY = bytes.fromhex("000102030405060708090a0b0c0d0e0f")
FIXED_WRONG = bytes.fromhex("f0e1d2c3b4a5968778695a4b3c2d1e0f")
READS_AS_TEXT_UNDER_THE_WRONG_KEY = "pw-000000161262"


def test_a_value_that_reads_as_text_under_the_wrong_legacy_key_is_held_not_rewritten(
        forge_tables: ForgeTables, tmp_path: Path) -> None:
    lucky = forge_encrypt("SM4", FIXED_LEGACY, READS_AS_TEXT_UNDER_THE_WRONG_KEY)
    garbage = forge_decrypt("SM4", FIXED_WRONG, lucky)  # the trap is real: padding and UTF-8 both pass
    assert garbage != READS_AS_TEXT_UNDER_THE_WRONG_KEY
    others = [forge_encrypt("SM4", FIXED_LEGACY, f"pw-{i}") for i in range(5)]
    create_tables(forge_tables)
    for i, v in enumerate([lucky, *others], start=1):
        forge_tables.execute("INSERT INTO ai_report_data_connection (id, password_cipher) VALUES (%s, %s)", (i, v))
    s = settings(forge_tables.url, bootstrap(tmp_path / "crypto.properties", legacy=FIXED_WRONG))
    before = forge_tables.column("ai_report_data_connection", "password_cipher")

    report = rotation.run_rotation(s, expected_key="k2")

    assert forge_tables.column("ai_report_data_connection", "password_cipher") == before
    result = report.targets["DataConnection"]
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED and result.reencrypted == 0
    assert "1" not in {f.id for f in result.failed} and result.counts["key_held"] >= 1
    assert {f.id for f in result.failed} == {str(i) for i, v in enumerate([lucky, *others], start=1)
                                              if not _reads_as_text_under("SM4", FIXED_WRONG, v)}
