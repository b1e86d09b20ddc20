"""The Forge sample (``seed --preset forge``): Forge's own tables (examples/forge.sql) with values as
Forge writes them, and a sample Forge bootstrap file to read them with, so that ``inventory``,
``run --dry-run``, ``run`` and ``gate --retire legacy`` can be tried in a minute.

The bootstrap file is written only where none exists (never over a real Forge's): an active key
``k2``, a historical key ``k1`` and a legacy key, fresh random TEST keys. The tables hold legacy
values (the bare SM4 / AES payload under the legacy key, from before Forge's write-versioned was
on) and FPC1 values on ``k1`` and ``k2``, in data connections and in one low-code table
(``crm_customer``, configured in ``ai_crud_config``). Synthetic values only.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psycopg

from .._primitives import EcbPkcs7
from ..errors import ConfigError
from ..schemes.fpc1_values import Algorithm, encode_payload, format_fpc1

EXAMPLES_SQL: Final = Path(__file__).resolve().parents[2] / "examples" / "forge.sql"
TABLES: Final = ("ai_report_data_connection", "ai_crud_config", "crm_customer")
ACTIVE, HISTORICAL = "k2", "k1"
P: Final = "forge.crypto.persistence."


@dataclass
class ForgeSampleKeys:
    """The sample's keys (kept out of repr)."""

    active: bytes = field(repr=False)
    historical: bytes = field(repr=False)
    legacy: bytes = field(repr=False)


@dataclass
class ForgeSeedSummary:
    bootstrap_file: str
    counts: dict[str, int]

    @property
    def total_rows(self) -> int:
        return sum(self.counts.values())


def write_sample_bootstrap(path: Path) -> ForgeSampleKeys:
    """A Forge bootstrap file with fresh TEST keys at ``path``; refused where a file exists."""
    keys = ForgeSampleKeys(secrets.token_bytes(16), secrets.token_bytes(16), secrets.token_bytes(16))

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode("ascii")

    text = "".join(f"{k}={v}\n" for k, v in (
        ("#", "Forge bootstrap file written by pinrotate's Forge sample: TEST KEYS ONLY"),
        (P + "enabled", "true"), (P + "write-versioned", "true"), (P + "legacy-read-enabled", "true"),
        (P + "active-key-id", ACTIVE), (P + "active-key", b64(keys.active)),
        (P + f"keys.{HISTORICAL}", b64(keys.historical)), (P + "legacy-key", b64(keys.legacy)),
    )).replace("#=", "# ", 1)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path}: a Forge bootstrap file exists already; the Forge sample writes its own only"
                          " where none is (point FORGE_CRYPTO_BOOTSTRAP_FILE elsewhere); nothing was written") from None
    with os.fdopen(fd, "w", encoding="latin-1") as f:
        f.write(text)
    return keys


def existing_tables(conn: psycopg.Connection[Any]) -> list[str]:
    rows = conn.execute("SELECT name FROM unnest(%s::text[]) AS name WHERE to_regclass(name) IS NOT NULL ORDER BY 1",
                        [list(TABLES)]).fetchall()
    return [str(r[0]) for r in rows]


DC_INSERT: Final = ("INSERT INTO ai_report_data_connection (id, tenant_id, connection_code, connection_name, jdbc_url,"
                    " username, password_cipher) VALUES (%s, %s, %s, %s, %s, %s, %s)")
CONFIG_INSERT: Final = ("INSERT INTO ai_crud_config (id, tenant_id, config_key, table_name, encrypt_config) VALUES "
                        "(1, 1, 'crm_customer', 'crm_customer', %s)")
CUSTOMER_INSERT: Final = "INSERT INTO crm_customer (id, tenant_id, name, phone, id_card) VALUES (%s, %s, %s, %s, %s)"


@dataclass
class ForgeSampleRows:
    """The sample's rows, for any engine (the statements above bind them with ``%s``)."""

    connections: list[tuple[Any, ...]]
    encrypt_config: str
    customers: list[tuple[Any, ...]]

    def counts(self) -> dict[str, int]:
        return {"ai_report_data_connection": len(self.connections), "ai_crud_config": 1,
                "crm_customer": len(self.customers)}


def seed_forge(conn: psycopg.Connection[Any], keys: ForgeSampleKeys, rows: int) -> dict[str, int]:
    """Forge's tables and ``rows`` customers (and a tenth as many data connections, at least 6)."""
    conn.execute(EXAMPLES_SQL.read_text(encoding="utf-8"))
    sample = sample_rows(keys, rows)
    conn.cursor().executemany(DC_INSERT, sample.connections)
    conn.execute(CONFIG_INSERT, (sample.encrypt_config,))
    conn.cursor().executemany(CUSTOMER_INSERT, sample.customers)
    return sample.counts()


def sample_rows(keys: ForgeSampleKeys, rows: int) -> ForgeSampleRows:
    """``rows`` customers (and a tenth as many data connections, at least 6), values as Forge writes them."""

    def legacy(algorithm: Algorithm, text: str) -> str:
        return encode_payload(EcbPkcs7(algorithm, keys.legacy).encrypt(text.encode()))

    def fpc1(algorithm: Algorithm, key_id: str, text: str) -> str:
        material = keys.active if key_id == ACTIVE else keys.historical
        return format_fpc1(algorithm, key_id, EcbPkcs7(algorithm, material).encrypt(text.encode()))

    connections = max(6, rows // 10)
    dc: list[tuple[Any, ...]] = []
    for i in range(1, connections + 1):
        password = f"sample-db-password-{i}"
        kind = i % 3
        value = (legacy("SM4", password) if kind == 0 else
                 fpc1("SM4" if i % 2 else "AES", HISTORICAL, password) if kind == 1 else fpc1("SM4", ACTIVE, password))
        dc.append((i, 1 + i % 2, f"conn_{i}", f"Sample connection {i}", f"jdbc:mysql://db{i}/app", "app", value))
    customers: list[tuple[Any, ...]] = []
    for i in range(1, rows + 1):
        phone, id_card = f"138{i:08d}", f"11010119900101{i % 10000:04d}"
        if i % 2:
            customers.append((i, 1 + i % 2, f"Customer {i}", legacy("SM4", phone), legacy("AES", id_card)))
        else:
            customers.append((i, 1 + i % 2, f"Customer {i}", fpc1("SM4", HISTORICAL, phone),
                              fpc1("AES", HISTORICAL, id_card) if i % 4 else None))
    return ForgeSampleRows(dc, json.dumps({"phone": {"algorithm": "SM4"}, "idCard": {"algorithm": "AES"}}), customers)
