"""``seed`` of the Pin profile on a MySQL configuration (contract §4), then the Pin rotation of what it
loaded, through the CLI as a user runs them (examples/pin-profile-mysql.toml). Every value is
read back by the tests' own AES-GCM code, never pinrotate's.
"""

from __future__ import annotations

import base64
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.mariadb_server import MariaDbServer

from .codecs import gcm_decrypt
from .support import EXAMPLES, connect, one_line_error, query, rotate, write_toml

pytestmark = pytest.mark.mysql

ROWS = 40
CIPHERS = {"persons": ("first_name_cipher", "last_name_cipher", "middle_name_cipher", "birth_date_cipher"),
           "person_documents": ("payload_cipher",),
           "requisite_templates": ("contact_email_cipher", "contact_phone_cipher"),
           "verification_requests": ("snapshot_cipher",)}
COUNTS = {"persons": ROWS, "person_documents": ROWS // 2, "requisite_templates": ROWS // 4,
          "verification_requests": ROWS // 4}


def _keys(path: Path) -> tuple[str, dict[str, bytes]]:
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    return str(doc["current"]), {str(k): base64.b64decode(v) for k, v in doc["keys"].items()}


def _read(server: MariaDbServer, database: str) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    with connect(server, database) as conn, conn.cursor() as cur:
        for table in CIPHERS:
            cur.execute(f"SELECT * FROM `{table}`")
            names = [d[0] for d in cur.description]
            out[table] = {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}
    return out


def _plaintexts(rows: dict[str, dict[str, dict[str, Any]]], keys: dict[str, bytes]) -> dict[tuple[str, str, str], Any]:
    """Every cipher value decrypted under the key its row names (None stays None)."""
    out: dict[tuple[str, str, str], Any] = {}
    for table, by_id in rows.items():
        for row_id, row in by_id.items():
            for column in CIPHERS[table]:
                value = row[column]
                out[(table, row_id, column)] = None if value is None else \
                    gcm_decrypt(keys[str(row["key_version"])], value)
    return out


def test_seed_loads_the_pin_profile_on_mariadb_and_the_pin_rotation_moves_it_all(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path,
        prefect_api: str) -> None:
    doc = tomllib.loads((EXAMPLES / "pin-profile-mysql.toml").read_text(encoding="utf-8"))
    doc["database"]["url"] = mariadb.url(mysql_database)
    doc["keys"]["file"] = str(tmp_path / "keys" / "keys.toml")  # absent: seed creates it, as a run would
    doc["job"].update({"batch_size": 7, "inter_batch_delay": 0})
    cfg = ("--config", str(write_toml(tmp_path / "pinrotate.toml", doc)))

    code, seeded, err = rotate("seed", "--rows", str(ROWS), *cfg, "--json")
    assert code == 0, err
    assert seeded["key"] == "1" and seeded["tables"] == {f"{mysql_database}.{t}": n for t, n in COUNTS.items()}
    assert seeded["rows"] == sum(COUNTS.values()) and seeded["drafts"] == 4  # requests 0, 3, 6, 9
    current, keys = _keys(tmp_path / "keys" / "keys.toml")
    assert current == "1" and list(keys) == ["1"]

    before = _read(mariadb, mysql_database)
    assert {t: len(rows) for t, rows in before.items()} == COUNTS
    plain = _plaintexts(before, keys)
    # The sample's deterministic plaintexts (examples/pin-profile.sql's seed on PostgreSQL), read by
    # the tests' own AES-GCM: every person's names, middle names on even rows only.
    firsts = sorted(v for (t, _, c), v in plain.items() if t == "persons" and c == "first_name_cipher")
    assert firsts == [f"First-{n:06d}".encode() for n in range(ROWS)]
    middles = sorted(v for (t, _, c), v in plain.items() if t == "persons" and c == "middle_name_cipher" and v)
    assert middles == [f"Middle-{n:06d}".encode() for n in range(0, ROWS, 2)]
    drafts = [r for r in before["verification_requests"].values() if r["status"] == "draft"]
    assert len(drafts) == 4 and all(r["snapshot_cipher"] is None and r["key_version"] is None for r in drafts)
    for row in before["person_documents"].values():
        assert b'"number":"' in plain[("person_documents", row["id"], "payload_cipher")]

    # Refused where its tables exist: one line, exit 2, nothing written.
    code, out, err = rotate("seed", "--rows", "5", *cfg, "--json")
    line = one_line_error(code, out, err, expected=2)
    assert mysql_database in line and "already holds" in line
    assert _read(mariadb, mysql_database) == before

    # The Pin rotation of what seed loaded: a new key, promoted, and a run.
    for args in (("keys", "add"), ("keys", "promote", "2")):
        code, _, err = rotate(*args, *cfg, "--json")
        assert code == 0, (args, err)
    code, inv, err = rotate("inventory", *cfg, "--json")
    assert code == 0, err
    assert inv["targets"]["Person"]["HISTORICAL"] == ROWS and inv["targets"]["VerificationRequest"]["EXCLUDED"] == 4
    code, run, err = rotate("run", *cfg, "--json", prefect_api=prefect_api)
    assert code == 0, err
    assert {n: t["backlog_remaining"] for n, t in run["targets"].items()} == dict.fromkeys(run["targets"], 0)
    _, keys = _keys(tmp_path / "keys" / "keys.toml")
    after = _read(mariadb, mysql_database)
    assert _plaintexts(after, keys) == plain
    for table, rows in after.items():
        for row_id, row in rows.items():
            was = before[table][row_id]
            assert row["key_version"] == (None if was["key_version"] is None else 2), (table, row_id)
            for column in ("version", "updated_at", "updated_by_user_id", "created_at"):
                assert row[column] == was[column], (table, row_id, column)
    with connect(mariadb, None) as conn:
        query(conn, "DELETE FROM pinrotate.key_checks WHERE database_name = %s", (mysql_database,))


@pytest.mark.parametrize("preset", ["pin-profile", "forge"])
def test_seed_refuses_a_url_that_names_no_database_in_one_line_writing_nothing(
        mariadb: MariaDbServer, tmp_path: Path, preset: str) -> None:
    example = "forge-mysql.toml" if preset == "forge" else "pin-profile-mysql.toml"
    doc = tomllib.loads((EXAMPLES / example).read_text(encoding="utf-8"))
    doc["database"]["url"] = mariadb.url("")  # the server, no database
    doc["keys"]["file"] = str(tmp_path / "keys" / "keyfile")  # forge: the bootstrap file seed would write
    cfg = ("--config", str(write_toml(tmp_path / "pinrotate.toml", doc)))

    code, out, err = rotate("seed", "--preset", preset, "--rows", "5", *cfg, "--json")
    line = one_line_error(code, out, err, expected=2)
    assert "database.url" in line and "names its database" in line, line
    if preset == "forge":  # Forge's bootstrap file is written only once the database is claimed
        assert not (tmp_path / "keys" / "keyfile").exists()
