"""``vault-transit`` on MySQL / MariaDB (contract §2, §5): a real OpenBao and a real MariaDB table,
through the command line. Values are made and checked through OpenBao's own HTTP API (not
pinrotate's provider): what a run wrote must decrypt, in Transit, to what the application stored.
"""

from __future__ import annotations

import base64
import datetime as dt
import secrets
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.mariadb_server import MariaDbServer
from tests.mysql_contract.support import connect, private_dir, query, rotate, write_toml
from tests.vault_server import BaoAdmin

pytestmark = [pytest.mark.mysql, pytest.mark.vault]

SEEDED = dt.datetime(2020, 1, 2, 3, 4, 5)


class Bao:
    """Transit through OpenBao's HTTP API, as the application (not pinrotate) uses it."""

    def __init__(self, server: Any) -> None:
        self.admin = BaoAdmin.of(server)
        self.mount, self.key = f"transit-my-{uuid.uuid4().hex[:8]}", "pii"
        self.admin.enable_secrets(self.mount, "transit")
        self.admin.api("POST", f"{self.mount}/keys/{self.key}", {"type": "aes256-gcm96"})

    def encrypt(self, plain: bytes) -> str:
        answer = self.admin.api("POST", f"{self.mount}/encrypt/{self.key}",
                                {"plaintext": base64.b64encode(plain).decode("ascii")})
        return str(answer["data"]["ciphertext"])

    def decrypt(self, value: str) -> bytes:
        answer = self.admin.api("POST", f"{self.mount}/decrypt/{self.key}", {"ciphertext": value})
        return base64.b64decode(answer["data"]["plaintext"])

    def rotate(self) -> None:
        self.admin.api("POST", f"{self.mount}/keys/{self.key}/rotate", {})


def _seed(server: MariaDbServer, database: str, bao: Bao) -> dict[tuple[str, int, str], bytes | None]:
    """``people`` (a key-version column, text and blob) and ``notes`` (none, varchar and text), rows
    on versions 1 and 2, then one more rotation: current is 3. Returns every plaintext."""
    plain: dict[tuple[str, int, str], bytes | None] = {}
    with connect(server, database) as conn:
        query(conn, "CREATE TABLE people (id BIGINT PRIMARY KEY, key_version INT NULL, name_cipher TEXT NULL,"
                    " doc_cipher BLOB NULL, version INT NOT NULL DEFAULT 7, updated_at DATETIME NOT NULL"
                    " DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP) ENGINE=InnoDB")
        query(conn, "CREATE TABLE notes (note_id BIGINT PRIMARY KEY, body_cipher VARCHAR(300) NULL,"
                    " tag_cipher TEXT NULL) ENGINE=InnoDB")
        for version in (1, 2):
            for i in range(version, 13, 2):
                name, doc = f"name-{i} 名".encode() + secrets.token_bytes(i), None if i % 5 == 0 else secrets.token_bytes(i)
                plain[("people", i, "name_cipher")], plain[("people", i, "doc_cipher")] = name, doc
                query(conn, "INSERT INTO people (id, key_version, name_cipher, doc_cipher, updated_at)"
                            " VALUES (%s, %s, %s, %s, %s)",
                      (i, version, bao.encrypt(name), None if doc is None else bao.encrypt(doc).encode("ascii"),
                       SEEDED))
                body, tag = f"note {i}".encode(), None if i % 4 == 0 else f"tag {i}".encode()
                plain[("notes", i, "body_cipher")], plain[("notes", i, "tag_cipher")] = body, tag
                query(conn, "INSERT INTO notes (note_id, body_cipher, tag_cipher) VALUES (%s, %s, %s)",
                      (i, bao.encrypt(body), None if tag is None else bao.encrypt(tag)))
            bao.rotate()
        # A row whose key-version column already says current while a value is older: the drain
        # (which selects by that column) does not take it; the inventory names it.
        plain[("people", 20, "name_cipher")], plain[("people", 20, "doc_cipher")] = b"behind", None
        bao_value = bao.admin.api("POST", f"{bao.mount}/encrypt/{bao.key}",
                                  {"plaintext": base64.b64encode(b"behind").decode(), "key_version": 2})
        query(conn, "INSERT INTO people (id, key_version, name_cipher, updated_at) VALUES (20, 3, %s, %s)",
              (bao_value["data"]["ciphertext"], SEEDED))
    return plain


def _config(tmp_path: Path, server: MariaDbServer, database: str, openbao: Any, bao: Bao) -> Path:
    return write_toml(private_dir(tmp_path / "cfg") / "pinrotate.toml", {  # it holds a (test) token
        "database": {"url": server.url(database)},
        "keys": {"provider": "vault-transit",
                 "vault": {"addr": openbao.addr, "token": openbao.token, "transit_mount": bao.mount, "key": bao.key}},
        "job": {"batch_size": 4, "inter_batch_delay": 0},
        "targets": [{"name": "People", "table": "people", "id": "id", "key_version": "key_version",
                     "columns": ["name_cipher", "doc_cipher"], "format": "vault-transit"},
                    {"name": "Notes", "table": "notes", "id": "note_id", "columns": ["body_cipher", "tag_cipher"],
                     "format": "vault-transit"}],
    })


@pytest.mark.server_wide  # its gate sweeps the whole server (tests/conftest.py, Parallel runs)
def test_vault_transit_runs_on_mariadb_rewrapping_every_value_to_the_latest_version(
        mariadb: MariaDbServer, mysql_database: str, openbao: Any, tmp_path: Path, prefect_api: str) -> None:
    bao = Bao(openbao)
    plain = _seed(mariadb, mysql_database, bao)
    cfg = ("--config", str(_config(tmp_path, mariadb, mysql_database, openbao, bao)))

    code, inv, err = rotate("inventory", *cfg, "--json")
    assert code == 0, err
    people, notes = inv["targets"]["People"], inv["targets"]["Notes"]
    assert inv["current_key"] == "3" and people["BLOCKED"] == 0 and notes["BLOCKED"] == 0, inv
    values = {t: sum(1 for (table, _, _), p in plain.items() if table == t and p is not None)
              for t in ("people", "notes")}
    assert people["HISTORICAL"] == values["people"] and notes["HISTORICAL"] == values["notes"], inv
    assert people["transit_latest_version"] == 3 and people["transit_rows_behind_key_version"] == 1, people

    code, dry, err = rotate("run", "--dry-run", *cfg, "--json", prefect_api=prefect_api)
    assert code == 0, err
    assert dry["targets"]["People"]["reencrypted"] == 12 and dry["targets"]["Notes"]["reencrypted"] == 12, dry

    code, doc, err = rotate("run", *cfg, "--json", prefect_api=prefect_api)
    assert code == 0, err
    assert doc["targets"]["People"]["reencrypted"] == 12 and doc["targets"]["Notes"]["reencrypted"] == 12, doc
    assert openbao.token not in err and openbao.token not in str(doc)

    with connect(mariadb, mysql_database) as conn:
        people_rows = {r[0]: r[1:] for r in query(conn, "SELECT id, key_version, name_cipher, doc_cipher,"
                                                        " version, updated_at FROM people")}
        note_rows = {r[0]: r[1:] for r in query(conn, "SELECT note_id, body_cipher, tag_cipher FROM notes")}
    for (table, row, column), expected in plain.items():
        if table == "people":
            kv, name, docv, version, updated = people_rows[row]
            stored = {"name_cipher": name, "doc_cipher": docv}[column]
            assert (version, updated) == (7, SEEDED), row  # only cipher and key-version columns change
            if row == 20:
                continue  # behind its key-version column: not taken by the drain, as on PostgreSQL
            assert kv == 3, row
        else:
            stored = dict(zip(("body_cipher", "tag_cipher"), note_rows[row], strict=True))[column]
        if expected is None:
            assert stored is None, (table, row, column)
            continue
        text = stored.decode("ascii") if isinstance(stored, bytes) else stored
        assert text.startswith("vault:v3:"), (table, row, column)
        assert bao.decrypt(text) == expected, (table, row, column)  # OpenBao itself, not pinrotate
    assert people_rows[20][1].startswith("vault:v2:")

    # Each Transit version's identity recorded for this database: the creation time OpenBao reports.
    versions = bao.admin.api("GET", f"{bao.mount}/keys/{bao.key}")["data"]["keys"]
    with connect(mariadb, None) as conn:
        recorded = {r[0]: r[1:] for r in query(conn, "SELECT key_id, check_value, algorithm, keyring FROM"
                                                     " pinrotate.key_checks WHERE database_name = %s",
                                               (mysql_database,))}
    assert recorded == {v: (str(versions[v]), "transit-creation-time:v1", f"vault-transit {bao.mount}/{bao.key}")
                        for v in ("1", "2", "3")}, recorded

    code, again, err = rotate("run", *cfg, "--json", prefect_api=prefect_api)  # nothing left: nothing written
    assert code == 0 and again["targets"]["People"]["reencrypted"] == 0 == again["targets"]["Notes"]["reencrypted"]

    # Version 2 is still held by row 20 (behind its key-version column); version 1 is free.
    code, gate, err = rotate("gate", "--retire", "1", *cfg, "--json")
    assert code == 0 and gate["open"] is True, (err, gate.get("blocking"))
    code, gate, err = rotate("gate", "--retire", "2", *cfg, "--json")
    assert code == 3 and gate["blocking"]["HISTORICAL"] == 1, gate


def test_an_application_edit_between_read_and_rewrap_is_never_overwritten_on_mariadb(
        mariadb: MariaDbServer, mysql_database: str, openbao: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compare-and-swap of every scheme: the application writes a row after the run read it and
    while Transit rewraps; that row keeps the application's value (left for the next run)."""
    from pinrotate_core.config import load_settings
    from pinrotate_core.rotation import run_rotation
    from pinrotate_core.schemes.transit import TransitScheme

    bao = Bao(openbao)
    plain = _seed(mariadb, mysql_database, bao)
    cfg = _config(tmp_path, mariadb, mysql_database, openbao, bao)
    edited = bao.encrypt(b"written by the application meanwhile")  # under the latest version
    plan = TransitScheme.plan

    def plan_then_edit(self: TransitScheme, rows: Any, known_failed: Any = ()) -> Any:
        out = plan(self, rows, known_failed)
        if self.target.name == "People" and any(r[0] == 3 for r in rows):
            with connect(mariadb, mysql_database) as app:  # the application's own session, committed
                query(app, "UPDATE people SET name_cipher = %s, key_version = 1 WHERE id = 3", (edited,))
        return out

    monkeypatch.setattr(TransitScheme, "plan", plan_then_edit)
    report = run_rotation(load_settings(cfg), target_names=["People"])
    assert report.targets["People"].reencrypted == 11, report.as_dict()
    with connect(mariadb, mysql_database) as conn:
        (name, kv), = query(conn, "SELECT name_cipher, key_version FROM people WHERE id = 3")
    assert (name, kv) == (edited, 1)  # the application's value stands; key_version 1: the next run takes it
    monkeypatch.undo()
    assert run_rotation(load_settings(cfg), target_names=["People"]).targets["People"].reencrypted == 1
    with connect(mariadb, mysql_database) as conn:
        (name,), = query(conn, "SELECT name_cipher FROM people WHERE id = 3")
    assert name.startswith("vault:v3:") and bao.decrypt(name) == b"written by the application meanwhile"
    assert plain[("people", 3, "name_cipher")] != b"written by the application meanwhile"
