"""A Forge installation on MariaDB (examples/forge-mysql.sql and .toml), with values as Forge
writes them, made by the tests' own encryptor; every value remembered with what it should become.

TEST KEYS ONLY: the active and the old key are random per test, under key ids of their own; the
legacy key is one fixed test key (see codecs.fixed_test_key).
"""

from __future__ import annotations

import json
import secrets
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.mariadb_server import MariaDbServer

from .codecs import fixed_test_key, forge_fpc1, forge_legacy
from .support import EXAMPLES, connect, forge_bootstrap, run_sql_file, write_toml

SEEDED_AT = "2020-01-02 03:04:05"  # create_time / update_time of every row: any touch moves update_time
TABLES = {"ai_report_data_connection": ("DataConnection", ("password_cipher",)),
          "crm_customer": ("lowcode:crm_customer", ("phone", "id_card"))}
# The legacy algorithm of each column: Forge's default (SM4) for data-connection passwords, the
# field's own algorithm in encrypt_config for low-code fields.
LEGACY_ALGORITHM = {"password_cipher": "SM4", "phone": "SM4", "id_card": "AES"}
ENCRYPT_CONFIG = {"phone": {"algorithm": "SM4"}, "idCard": {"algorithm": "AES"}}
CATEGORIES = ("ACTIVE", "HISTORICAL", "NEWER", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "EXCLUDED", "FAILED",
              "CONFLICT", "BLOCKED")

# (kind, algorithm) per value. Kinds: legacy (bare payload under the legacy key, in the column's
# legacy algorithm), old (FPC1 under the old key), old-lower (algorithm code in lower case),
# old-hex (hex payload), active, unknown (FPC1 with an algorithm Forge does not know), null, blank.
Spec = tuple[str, str | None]
DATA_CONNECTIONS: dict[int, tuple[int, str, Spec]] = {  # id: (tenant, del_flag, value)
    1: (1, "0", ("legacy", None)),
    2: (2, "0", ("legacy", None)),
    3: (1, "0", ("old", "SM4")),
    4: (1, "0", ("old", "AES")),          # an AES password in an SM4 column keeps AES
    5: (2, "0", ("old-lower", "AES")),
    6: (1, "0", ("old-hex", "SM4")),
    7: (1, "0", ("active", "SM4")),
    8: (1, "0", ("null", None)),
    9: (1, "0", ("blank", None)),
    10: (2, "0", ("blank-spaces", None)),
    11: (1, "1", ("legacy", None)),       # soft-deleted: EXCLUDED, never read for migration nor changed
    12: (1, "0", ("unknown", "AES")),     # FPC1:AES-GCM:...: UNKNOWN, left for a person
}
CUSTOMERS: dict[int, tuple[int, str, Spec, Spec]] = {  # id: (tenant, del_flag, phone, id_card)
    1: (1, "0", ("legacy", None), ("legacy", None)),
    2: (2, "0", ("legacy", None), ("null", None)),
    3: (1, "0", ("old", "SM4"), ("old", "AES")),
    4: (1, "0", ("old", "AES"), ("legacy", None)),
    5: (2, "0", ("active", "SM4"), ("active", "AES")),
    6: (1, "0", ("blank", None), ("null", None)),
    7: (1, "1", ("active", "SM4"), ("null", None)),
    **{i: (1 + i % 2, "0", ("legacy", None) if i % 3 else ("old", "SM4"), ("old", "AES") if i % 2 else ("legacy", None))
       for i in range(8, 20)},
}


@dataclass
class Value:
    table: str
    row: int
    column: str
    kind: str
    algorithm: str | None   # the value's own algorithm (a legacy value's: its column's)
    deleted: bool
    plaintext: str | None
    stored: str | None      # as seeded

    @property
    def target(self) -> str:
        return TABLES[self.table][0]

    @property
    def is_ciphertext(self) -> bool:
        return self.kind not in ("null", "blank", "blank-spaces")

    @property
    def moves(self) -> bool:
        """A run re-encrypts it: a live legacy or historical value."""
        return not self.deleted and (self.kind == "legacy" or self.kind.startswith("old"))

    @property
    def category(self) -> str | None:
        if not self.is_ciphertext:
            return None
        if self.deleted:
            return "EXCLUDED"
        return {"legacy": "LEGACY", "active": "ACTIVE", "unknown": "UNKNOWN"}.get(self.kind, "HISTORICAL")


@dataclass
class ForgeInstall:
    server: MariaDbServer
    database: str
    config: Path
    active: str
    old: str
    keys: dict[str, bytes]
    legacy: bytes
    values: list[Value] = field(default_factory=list)

    def counts(self, target: str) -> dict[str, int]:
        found = Counter(v.category for v in self.values if v.target == target and v.category)
        return {c: found.get(c, 0) for c in CATEGORIES}

    def moved(self, target: str) -> int:
        return sum(v.moves for v in self.values if v.target == target)

    def rows(self, table: str) -> tuple[list[str], dict[int, dict[str, Any]]]:
        with connect(self.server, self.database) as conn, conn.cursor() as cur:
            cur.execute(f"SELECT * FROM `{table}` ORDER BY id")
            names = [d[0] for d in cur.description]
            return names, {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}

    def snapshot(self) -> dict[str, dict[int, dict[str, Any]]]:
        return {table: self.rows(table)[1] for table in (*TABLES, "ai_crud_config")}


def _value(install: ForgeInstall, table: str, row: int, column: str, spec: Spec, deleted: bool) -> Value:
    kind, algorithm = spec
    plaintext = f"{table}-{row}-{column} 口令 {secrets.token_hex(3)}" if kind not in ("null", "blank", "blank-spaces") \
        else None
    old_key, active_key = install.keys[install.old], install.keys[install.active]
    stored: str | None
    if kind == "legacy":
        algorithm = LEGACY_ALGORITHM[column]
        stored = forge_legacy(algorithm, install.legacy, plaintext or "")
    elif kind == "old":
        stored = forge_fpc1(algorithm or "SM4", install.old, old_key, plaintext or "")
    elif kind == "old-lower":
        stored = forge_fpc1(algorithm or "SM4", install.old, old_key, plaintext or "", code=(algorithm or "").lower())
    elif kind == "old-hex":
        stored = forge_fpc1(algorithm or "SM4", install.old, old_key, plaintext or "", hex_payload=True)
    elif kind == "active":
        stored = forge_fpc1(algorithm or "SM4", install.active, active_key, plaintext or "")
    elif kind == "unknown":
        stored = forge_fpc1("AES", install.old, old_key, plaintext or "", code="AES-GCM")
    else:
        stored = {"null": None, "blank": "", "blank-spaces": "   "}[kind]
    return Value(table, row, column, kind, algorithm, deleted, plaintext, stored)


def install_forge(server: MariaDbServer, database: str, tmp_path: Path, **job: Any) -> ForgeInstall:
    """Forge's tables with the rows above, Forge's bootstrap file, and examples/forge-mysql.toml
    pointed at this database and that file (a small batch size, so that every target takes
    several batches)."""
    run_sql_file(server, database, EXAMPLES / "forge-mysql.sql")
    active, old = f"act{secrets.token_hex(5)}", f"old{secrets.token_hex(5)}"
    keys = {active: secrets.token_bytes(16), old: secrets.token_bytes(16)}
    legacy = fixed_test_key("forge legacy")
    bootstrap = forge_bootstrap(tmp_path / "forge" / "crypto.properties", active, keys, legacy)
    doc = tomllib.loads((EXAMPLES / "forge-mysql.toml").read_text(encoding="utf-8"))
    doc["database"]["url"] = server.url(database)
    doc["keys"]["file"] = str(bootstrap)
    doc["job"].update({"batch_size": 3, "inter_batch_delay": 0, **job})
    install = ForgeInstall(server, database, write_toml(tmp_path / "forge-mysql.toml", doc), active, old, keys, legacy)

    with connect(server, database) as conn, conn.cursor() as cur:
        for row, (tenant, flag, spec) in DATA_CONNECTIONS.items():
            v = _value(install, "ai_report_data_connection", row, "password_cipher", spec, flag == "1")
            install.values.append(v)
            cur.execute("INSERT INTO ai_report_data_connection (id, tenant_id, connection_code, connection_name, db_type,"
                        " driver_class_name, jdbc_url, username, password_cipher, create_time, update_time, del_flag)"
                        " VALUES (%s, %s, %s, %s, 'MYSQL', 'com.mysql.cj.jdbc.Driver', %s, 'report_user', %s, %s, %s, %s)",
                        (row, tenant, f"conn_{row}", f"连接 {row}", f"jdbc:mysql://10.0.0.{row}:3306/dw", v.stored,
                         SEEDED_AT, SEEDED_AT, flag))
        for row, (tenant, flag, phone, id_card) in CUSTOMERS.items():
            p = _value(install, "crm_customer", row, "phone", phone, flag == "1")
            c = _value(install, "crm_customer", row, "id_card", id_card, flag == "1")
            install.values += [p, c]
            cur.execute("INSERT INTO crm_customer (id, tenant_id, customer_name, phone, id_card, create_time,"
                        " update_time, del_flag) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                        (row, tenant, f"客户 {row}", p.stored, c.stored, SEEDED_AT, SEEDED_AT, flag))
        cur.execute("INSERT INTO ai_crud_config (id, tenant_id, config_key, table_name, table_comment, encrypt_config,"
                    " create_time, update_time) VALUES (1, 1, 'crm_customer', 'crm_customer', '客户', %s, %s, %s),"
                    " (2, 1, 'crm_plain', 'crm_customer', '客户（无加密）', '{}', %s, %s),"
                    " (3, 1, 'crm_none', 'crm_customer', '客户（未配置）', NULL, %s, %s)",
                    (json.dumps(ENCRYPT_CONFIG), SEEDED_AT, SEEDED_AT, SEEDED_AT, SEEDED_AT, SEEDED_AT, SEEDED_AT))
    return install
