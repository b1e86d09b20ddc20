"""What keeps a target or a retire gate closed on MariaDB (contract §3 ``triggers``, §6 BLOCKED,
IN_FLIGHT, OUTSIDE_TARGETS): an UPDATE trigger, an application transaction still writing under
the old key, and a value under the old key in another database of the same server.
"""

from __future__ import annotations

import json
import secrets
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

from .codecs import forge_fpc1
from .forge_data import install_forge
from .pin_data import PERSON_CIPHERS, SEEDED_AT, install_pin, person_plaintexts
from .support import application, connect, file_keyring, one_line_error, query, rotate, write_toml

# Every test here asks a gate, which sweeps every database of the server and waits for every
# transaction in flight on it. On the shared MariaDB that would hold the server alone
# (server_wide) and hold up every other MySQL test meanwhile: the module has a mariadbd of its
# own instead (``mariadb`` and ``mysql_database``: tests/mariadb_server.private_mariadb), its tests on one worker.
pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_gate_on_mariadb")]


INSERT_PERSON = ("INSERT INTO persons (id, first_name_cipher, last_name_cipher, middle_name_cipher, birth_date_cipher,"
                 " key_version) VALUES (%s, %s, %s, %s, %s, %s)")


def positive(blocking: dict[str, int]) -> dict[str, int]:
    return {k: n for k, n in blocking.items() if n}


def gate(cfg: Path, key: str) -> tuple[int, dict[str, Any]]:
    code, doc, err = rotate("gate", "--retire", key, "--config", str(cfg), "--json")
    assert code in (0, 3), err
    assert doc["key"] == key and doc["open"] is (code == 0), doc
    return code, doc


# -- UPDATE triggers --------------------------------------------------------------------------------


def test_a_table_with_an_update_trigger_is_blocked_and_untouched_unless_triggers_fire(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path, prefect_api: str) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=12, documents=0)
    new = pin.promote_new_key()
    with connect(mariadb, mysql_database) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE person_audit (id bigint AUTO_INCREMENT PRIMARY KEY, person_id char(36) NOT NULL,"
                    " changed_at datetime(6) NOT NULL)")
        cur.execute("CREATE TRIGGER persons_audit AFTER UPDATE ON persons FOR EACH ROW"
                    " INSERT INTO person_audit (person_id, changed_at) VALUES (NEW.id, NOW(6))")

    def audit_rows() -> int:
        with connect(mariadb, mysql_database) as conn, conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) FROM person_audit")
            return int(cur.fetchone()[0])  # type: ignore[index]

    block = pin.config("block.toml", tables=("persons",))
    code, inv, err = rotate("inventory", "--config", str(block), "--json")
    assert code == 0, err
    assert inv["targets"]["Person"]["BLOCKED"] >= 1
    code, doc = gate(block, str(pin.old))
    assert code == 3 and doc["blocking"].get("BLOCKED", 0) >= 1

    before = pin.rows("persons")
    # MySQL has no session_replication_role: "disable" cannot be honoured and is refused as well.
    disable = pin.config("disable.toml", tables=("persons",), target={"triggers": "disable"})
    for cfg, extra in ((block, ()), (block, ("--dry-run",)), (disable, ())):
        line = one_line_error(*rotate("run", *extra, "--config", str(cfg), "--json", prefect_api=prefect_api),
                              expected=2)
        assert "persons_audit" in line, line  # the trigger is named
    assert pin.rows("persons") == before and audit_rows() == 0

    fire = pin.config("fire.toml", tables=("persons",), target={"triggers": "fire"})
    code, report, err = rotate("run", "--config", str(fire), "--json", prefect_api=prefect_api)
    assert code == 0, err
    assert (report["targets"]["Person"]["reencrypted"], report["targets"]["Person"]["failed"]) == (12, 0)
    assert audit_rows() == 12  # the side effect the operator accepted: one audit row per row written
    read = pin.read("persons", {new: pin.keys[new]})
    assert {row_id: plain for row_id, (_, plain) in read.items()} == \
        {row_id: plain for (_, row_id), plain in pin.plain.items()}
    assert {row["updated_at"] for row in pin.rows("persons").values()} == {SEEDED_AT}


# -- transactions in flight -------------------------------------------------------------------------


def test_an_uncommitted_write_under_the_old_key_keeps_the_gate_closed_until_it_ends(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=6, documents=0)
    new = pin.promote_new_key()
    with application(mariadb, mysql_database) as app, app.cursor() as cur:  # everything already on the new key
        for (_, row_id), plain in pin.plain.items():
            c = pin.encrypt_person(new, plain)
            cur.execute("UPDATE persons SET first_name_cipher = %s, last_name_cipher = %s, middle_name_cipher = %s,"
                        " birth_date_cipher = %s, key_version = %s WHERE id = %s",
                        (*(c[k] for k in PERSON_CIPHERS), new, row_id))
    settled = pin.config("pinrotate.toml", tables=("persons",))
    short = pin.config("short-wait.toml", tables=("persons",), gate={"wait": 2})
    old = str(pin.old)
    assert gate(settled, old)[0] == 0  # nothing on the old key, nothing in flight: open

    # An INSERT under the old key, not committed: invisible to any snapshot, yet it can still commit.
    with application(mariadb, mysql_database) as app, app.cursor() as cur:
        cur.execute("BEGIN")
        c = pin.encrypt_person(pin.old, person_plaintexts(99))
        cur.execute(INSERT_PERSON, (str(uuid.uuid4()), *(c[k] for k in PERSON_CIPHERS), pin.old))
        code, doc = gate(short, old)
        assert code == 3 and positive(doc["blocking"]) == {"IN_FLIGHT": doc["blocking"]["IN_FLIGHT"]}
        assert doc["blocking"]["IN_FLIGHT"] >= 1
        cur.execute("ROLLBACK")
    assert gate(settled, old)[0] == 0

    # An UPDATE back to the old key, not committed; then it commits: the gate was right to wait.
    row_id = next(iter(pin.rows("persons")))
    with application(mariadb, mysql_database) as app, app.cursor() as cur:
        cur.execute("BEGIN")
        c = pin.encrypt_person(pin.old, pin.plain[("persons", row_id)])
        cur.execute("UPDATE persons SET first_name_cipher = %s, last_name_cipher = %s, middle_name_cipher = %s,"
                    " birth_date_cipher = %s, key_version = %s WHERE id = %s",
                    (*(c[k] for k in PERSON_CIPHERS), pin.old, row_id))
        code, doc = gate(short, old)
        assert code == 3 and doc["blocking"].get("IN_FLIGHT", 0) >= 1 and doc["blocking"].get("HISTORICAL", 0) == 0
        cur.execute("COMMIT")
    code, doc = gate(settled, old)
    assert code == 3 and positive(doc["blocking"]) == {"HISTORICAL": 1}


# -- the sweep outside the targets ------------------------------------------------------------------


def fpc1_secrets(server: MariaDbServer, database: str, tmp_path: Path) -> tuple[Path, str, str, dict[str, bytes]]:
    """One fpc1 target, every value on the active key; a ``file`` keyring with the old key too."""
    active, old = f"act{secrets.token_hex(5)}", f"old{secrets.token_hex(5)}"
    keys = {active: secrets.token_bytes(16), old: secrets.token_bytes(16)}
    keys_file = file_keyring(tmp_path / "keys" / "keys.toml", active, keys)
    with connect(server, database) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE api_secrets (id bigint PRIMARY KEY, name varchar(64) NOT NULL,"
                    " secret_cipher varchar(500) NULL) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4")
        for i in range(1, 6):
            cur.execute("INSERT INTO api_secrets VALUES (%s, %s, %s)",
                        (i, f"client-{i}", forge_fpc1("SM4", active, keys[active], f"s3cr3t-{i}")))
    cfg = write_toml(tmp_path / "pinrotate.toml", {
        "database": {"url": server.url(database)},
        "keys": {"provider": "file", "file": str(keys_file), "write_versioned": True},
        "job": {"batch_size": 2, "inter_batch_delay": 0},
        "targets": [{"name": "ApiSecret", "table": "api_secrets", "id": "id", "columns": ["secret_cipher"],
                     "format": "fpc1"}],
    })
    return cfg, active, old, keys


def test_a_value_under_the_old_key_in_another_database_of_the_server_keeps_the_gate_closed(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    cfg, _, old, keys = fpc1_secrets(mariadb, mysql_database, tmp_path)
    with mariadb.fresh_database() as other:
        with connect(mariadb, other) as conn, conn.cursor() as cur:
            # A copy someone made: not a configured target, and another database (schema) at that.
            cur.execute("CREATE TABLE stash (id int PRIMARY KEY, note text NULL) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4")
            cur.execute("INSERT INTO stash VALUES (1, %s), (2, 'nothing here')",
                        (forge_fpc1("SM4", old, keys[old], "copied secret"),))
        code, doc = gate(cfg, old)
        assert code == 3 and positive(doc["blocking"]) == {"OUTSIDE_TARGETS": 1}
        assert f"{other}.stash.note" in json.dumps(doc)  # named schema.table.column, never a value
        assert "copied secret" not in json.dumps(doc)
        with connect(mariadb, other) as conn, conn.cursor() as cur:
            cur.execute("UPDATE stash SET note = NULL WHERE id = 1")
        code, doc = gate(cfg, old)
        assert code == 0 and positive(doc["blocking"]) == {}


@pytest.mark.server_wide  # the sweep reads every database of the server (tests/conftest.py, Parallel runs)
def test_inventory_discover_on_mariadb_lists_ciphertexts_outside_the_targets(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    forge = install_forge(mariadb, mysql_database, tmp_path)
    old_value = next(v for v in forge.values if v.kind == "old" and v.table == "ai_report_data_connection")
    active_value = next(v for v in forge.values if v.kind == "active")
    with connect(mariadb, mysql_database) as conn:
        # A copy the application made: one value under the old key, one under the active one, and
        # one inside free text; a MyISAM table outside any snapshot.
        query(conn, "CREATE TABLE conn_backup (id INT PRIMARY KEY, pw VARCHAR(500), note TEXT) ENGINE=InnoDB")
        query(conn, "INSERT INTO conn_backup VALUES (1, %s, NULL), (2, %s, %s)",
              (old_value.stored, active_value.stored, f"copied from {old_value.stored} by hand"))
        query(conn, "CREATE TABLE cache_myisam (id INT PRIMARY KEY, v TEXT) ENGINE=MyISAM")
    before = forge.snapshot()
    code, doc, err = rotate("inventory", "--discover", "--config", str(forge.config), "--json")
    assert code == 0, err
    mine = {f["column"]: f["by_key"] for f in doc["discovered"] if f["column"].startswith(f"{mysql_database}.")}
    assert mine == {f"{mysql_database}.conn_backup.pw": {forge.old: 1, forge.active: 1},
                    f"{mysql_database}.conn_backup.note": {forge.old: 1}}, doc["discovered"]
    assert f"{mysql_database}.cache_myisam" in doc["discovery"]["unswept"], doc["discovery"]
    # The configured (and discovered Forge) targets are counted by the inventory, not listed as finds.
    assert doc["targets"]["DataConnection"]["HISTORICAL"] == forge.counts("DataConnection")["HISTORICAL"]
    assert forge.snapshot() == before
    for secret in (old_value.stored, active_value.stored):
        assert secret not in err and secret not in str(doc)
