"""The Pin profile (``aesgcm``) on MariaDB: pin_profile_mysql.sql with rows under an old key,
encrypted by the tests' own AES-GCM code, a ``file`` keyring and a configuration file.

TEST KEYS ONLY, random per test; key versions are random integers so that no two tests (nor
two runs of the suite) hold other material under one key id on a shared server.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import secrets
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.mariadb_server import MariaDbServer

from .codecs import gcm_decrypt, gcm_encrypt, gcm_read_text, gcm_text
from .support import HERE, connect, file_keyring, run_sql_file, write_toml

PERSON_CIPHERS = ("first_name_cipher", "last_name_cipher", "middle_name_cipher", "birth_date_cipher")
DOCUMENT_CIPHERS = ("payload_cipher",)
CIPHERS = {"persons": PERSON_CIPHERS, "person_documents": DOCUMENT_CIPHERS}
TARGET_OF = {"persons": "Person", "person_documents": "PersonDocument"}
SEEDED_AT = dt.datetime(2021, 3, 4, 5, 6, 7, 123456)
DOCUMENT_SEEDED_AT = dt.datetime(2021, 3, 4, 5, 6, 7)  # timestamp: whole seconds
Plain = dict[str, bytes | None]


@dataclass
class PinInstall:
    server: MariaDbServer
    database: str
    tmp: Path
    keys_file: Path
    old: int
    keys: dict[int, bytes]
    plain: dict[tuple[str, str], Plain] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url(self.database)

    def config(self, name: str = "pinrotate.toml", *, tables: tuple[str, ...] = ("persons", "person_documents"),
               target: dict[str, Any] | None = None, gate: dict[str, Any] | None = None, **job: Any) -> Path:
        """A configuration file as a user writes it for this database (``target``: settings added
        to every target, e.g. ``triggers``)."""
        doc: dict[str, Any] = {
            "database": {"url": self.url},
            "keys": {"provider": "file", "file": str(self.keys_file)},
            "job": {"batch_size": 7, "inter_batch_delay": 0, "max_degree_of_parallelism": 1, **self.job, **job},
            "targets": [{"name": TARGET_OF[t], "table": t, "id": "id", "key_version": "key_version",
                         "columns": list(CIPHERS[t]), "format": "aesgcm", **(target or {})} for t in tables],
        }
        if gate:
            doc["gate"] = gate
        return write_toml(self.tmp / name, doc)

    @property
    def new(self) -> int:
        return max(self.keys)

    def promote_new_key(self) -> int:
        """Add a fresh key ``old + 1`` and make it current, as ``keys add`` + ``keys promote`` do."""
        new = self.old + 1
        self.keys[new] = secrets.token_bytes(32)
        file_keyring(self.keys_file, new, self.keys)
        return new

    def load_keys(self) -> tuple[str, dict[int, bytes]]:
        """The keyring file as it is now (after ``keys add`` / ``promote``): current and material."""
        doc = tomllib.loads(self.keys_file.read_text(encoding="utf-8"))
        return str(doc["current"]), {int(k): base64.b64decode(v) for k, v in doc["keys"].items()}

    def rows(self, table: str) -> dict[str, dict[str, Any]]:
        with connect(self.server, self.database) as conn, conn.cursor() as cur:
            cur.execute(f"SELECT * FROM `{table}` ORDER BY id")
            names = [d[0] for d in cur.description]
            return {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}

    def read(self, table: str, keys: dict[int, bytes]) -> dict[str, tuple[int, Plain]]:
        """Every row decrypted by the test's own code under the key its key_version names:
        (key_version, plaintext per cipher column). Raises if any value does not decrypt."""
        out = {}
        for row_id, row in self.rows(table).items():
            key = keys[row["key_version"]]
            plain: Plain = {}
            for column in CIPHERS[table]:
                value = row[column]
                if value is None:
                    plain[column] = None
                elif table == "persons":
                    plain[column] = gcm_read_text(key, value)
                else:
                    plain[column] = gcm_decrypt(key, bytes(value))
            out[row_id] = (row["key_version"], plain)
        return out

    def key_versions(self, table: str) -> dict[int, int]:
        found: dict[int, int] = {}
        for row in self.rows(table).values():
            found[row["key_version"]] = found.get(row["key_version"], 0) + 1
        return found

    def encrypt_person(self, key_id: int, plain: Plain) -> dict[str, str | None]:
        key = self.keys[key_id]
        return {c: None if plain[c] is None else gcm_text(key, plain[c] or b"") for c in PERSON_CIPHERS}


def person_plaintexts(i: int) -> Plain:
    return {"first_name_cipher": f"Имя-{i} {secrets.token_hex(2)}".encode(),
            "last_name_cipher": f"Фамилия-{i}".encode(),
            "middle_name_cipher": None if i % 4 == 0 else f"Отчество-{i}".encode(),
            "birth_date_cipher": None if i % 5 == 0 else f"19{50 + i % 50:02d}-0{1 + i % 9}-1{i % 10}".encode()}


def install_pin(server: MariaDbServer, database: str, tmp_path: Path, *, persons: int = 30, documents: int = 12,
                **job: Any) -> PinInstall:
    """The schema and rows under the old key; the keyring holds only the old key, current."""
    run_sql_file(server, database, HERE / "pin_profile_mysql.sql")
    old = 100_000 + secrets.randbelow(800_000_000)
    keys = {old: secrets.token_bytes(32)}
    keys_file = file_keyring(tmp_path / "keys" / "keys.toml", old, keys)
    pin = PinInstall(server, database, tmp_path, keys_file, old, keys, job=job)
    with connect(server, database) as conn, conn.cursor() as cur:
        for i in range(persons):
            row_id = str(uuid.UUID(int=secrets.randbits(128), version=4))
            plain = person_plaintexts(i)
            pin.plain[("persons", row_id)] = plain
            c = pin.encrypt_person(old, plain)
            cur.execute("INSERT INTO persons (id, owner_user_id, first_name_cipher, last_name_cipher,"
                        " middle_name_cipher, birth_date_cipher, key_version, gender, version, created_at,"
                        " updated_at, updated_by_user_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                        (row_id, str(uuid.uuid4()), c["first_name_cipher"], c["last_name_cipher"],
                         c["middle_name_cipher"], c["birth_date_cipher"], old, "F" if i % 2 else "M", 1 + i % 5,
                         SEEDED_AT, SEEDED_AT, str(uuid.uuid4())))
        for i in range(documents):
            row_id = str(uuid.uuid4())
            number = f"45 0{i} 12345{i}".encode()
            pin.plain[("person_documents", row_id)] = {"payload_cipher": b'{"number": "' + number + b'"}'}
            cur.execute("INSERT INTO person_documents (id, person_id, document_type, payload_cipher, number_hash,"
                        " number_mask, key_version, version, updated_at, updated_by_user_id)"
                        " VALUES (%s, %s, 'passport', %s, %s, %s, %s, %s, %s, %s)",
                        (row_id, str(uuid.uuid4()), gcm_encrypt(keys[old], pin.plain[("person_documents", row_id)]
                                                                ["payload_cipher"] or b""),
                         hashlib.sha256(number).digest(), "45 ** ****" + str(i), old, 3, DOCUMENT_SEEDED_AT,
                         str(uuid.uuid4())))
    return pin
