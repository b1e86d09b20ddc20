"""The Pin profile sample: its schema, its configuration, and fast synthetic sample data.

Sample plaintexts are synthetic and deterministic (``First-000123``, ``user000123@example.test``),
derived from a seed and the row number only, so tests can recompute what every value must decrypt
to. This module must never hold or produce real personal data, and never log a value.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import hmac
import json
import os
import secrets
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ..errors import ConfigError
from ..keyring import Keyring, is_version
from ..schemes.aesgcm import AesGcmCipherSet

REPO_ROOT = Path(__file__).resolve().parents[2]
PIN_PROFILE_SQL: Path = REPO_ROOT / "examples" / "pin-profile.sql"
PIN_PROFILE_TOML: Path = REPO_ROOT / "examples" / "pin-profile.toml"

SCHEMA = "profile"
PERSONS = "persons"
PERSON_DOCUMENTS = "person_documents"
REQUISITE_TEMPLATES = "requisite_templates"
VERIFICATION_REQUESTS = "verification_requests"
TABLES = (PERSONS, PERSON_DOCUMENTS, REQUISITE_TEMPLATES, VERIFICATION_REQUESTS)

# Cipher columns per table (the order of examples/pin-profile.toml).
CIPHER_COLUMNS: dict[str, tuple[str, ...]] = {
    PERSONS: ("first_name_cipher", "last_name_cipher", "middle_name_cipher", "birth_date_cipher"),
    PERSON_DOCUMENTS: ("payload_cipher",),
    REQUISITE_TEMPLATES: ("contact_email_cipher", "contact_phone_cipher"),
    VERIFICATION_REQUESTS: ("snapshot_cipher",),
}

_NONCE_LEN = 12
_EPOCH = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
_BIRTH_ORDINAL = dt.date(1940, 1, 1).toordinal()

Plaintexts = dict[str, bytes | None]


def apply_pin_profile_schema(conn: psycopg.Connection[Any]) -> None:
    """Create schema ``profile`` and its four tables if missing (idempotent)."""
    # Several statements, no parameters: psycopg sends them as one simple query.
    conn.execute(PIN_PROFILE_SQL.read_text(encoding="utf-8").encode())


# -- deterministic synthetic rows ---------------------------------------------------------------
#
# Which optional values are NULL follows the row number (not chance), so any run of a few
# consecutive rows has every case: middle name on even rows, birth date on n % 10 < 7, template
# contacts by n % 4 (none / email / phone / both), drafts on n % 3 == 0. Ids, birth dates and
# document numbers come from a hash of (seed, table, row number).

_DOC_TYPES = ("passport", "snils", "inn")


@functools.lru_cache(maxsize=64)
def _hash_base(seed: int, table: str) -> Any:
    return hashlib.blake2b(f"pinrotate-preset:{seed}:{table}:".encode(), digest_size=64)


def _digest(seed: int, table: str, n: int) -> bytes:
    # Copying a primed hash is about 3x cheaper than hashing a fresh string per row.
    h = _hash_base(seed, table).copy()
    h.update(n.to_bytes(8, "little"))
    return bytes(h.digest())


# Lookup tables for the version and variant bytes of a v4 UUID: cheaper than a bytearray per id.
_UUID_VERSION_BYTE = tuple(bytes(((b & 0x0F) | 0x40,)) for b in range(256))
_UUID_VARIANT_BYTE = tuple(bytes(((b & 0x3F) | 0x80,)) for b in range(256))


def _uuid_bytes(raw: bytes) -> bytes:
    """16 bytes of a version-4 UUID (what ``uuid.UUID(bytes=raw, version=4)`` would hold)."""
    return raw[:6] + _UUID_VERSION_BYTE[raw[6]] + raw[7:8] + _UUID_VARIANT_BYTE[raw[8]] + raw[9:16]


def row_id(seed: int, table: str, n: int) -> uuid.UUID:
    """The primary key of row number ``n`` of ``table`` (a table name without schema)."""
    return uuid.UUID(bytes=_uuid_bytes(_digest(seed, table, n)))


def person_id(seed: int, n: int) -> uuid.UUID:
    return row_id(seed, PERSONS, n)


def _birth_date(digest: bytes) -> str:
    return dt.date.fromordinal(_BIRTH_ORDINAL + int.from_bytes(digest[32:36], "big") % 25_000).isoformat()


def _document_number(digest: bytes) -> str:
    return f"{int.from_bytes(digest[36:44], 'big') % 10**10:010d}"


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def is_draft(n: int) -> bool:
    return n % 3 == 0


def person_plaintexts(seed: int, n: int, digest: bytes | None = None) -> Plaintexts:
    d = digest if digest is not None else _digest(seed, PERSONS, n)
    return {
        "first_name_cipher": f"First-{n:06d}".encode(),
        "last_name_cipher": f"Last-{n:06d}".encode(),
        "middle_name_cipher": f"Middle-{n:06d}".encode() if n % 2 == 0 else None,
        "birth_date_cipher": _birth_date(d).encode() if n % 10 < 7 else None,
    }


def document_plaintexts(seed: int, n: int, digest: bytes | None = None) -> Plaintexts:
    d = digest if digest is not None else _digest(seed, PERSON_DOCUMENTS, n)
    number = _document_number(d)
    # Canonical JSON (sorted keys, no spaces) written directly: json.dumps is the seeder's hot spot.
    payload = (f'{{"issued_by":"Synthetic Authority {n % 97}","issued_on":"{_birth_date(d)}",'
               f'"number":"{number[4:]}","series":"{number[:4]}","type":"{_DOC_TYPES[n % 3]}"}}')
    return {"payload_cipher": payload.encode()}


def template_plaintexts(seed: int, n: int, digest: bytes | None = None) -> Plaintexts:
    kind = n % 4
    return {
        "contact_email_cipher": f"user{n:06d}@example.test".encode() if kind in (1, 3) else None,
        "contact_phone_cipher": f"+1555{n:07d}".encode() if kind in (2, 3) else None,
    }


def request_plaintexts(seed: int, n: int, digest: bytes | None = None) -> Plaintexts:
    if is_draft(n):
        return {"snapshot_cipher": None}
    mask = "******" + _document_number(_digest(seed, PERSON_DOCUMENTS, n))[-4:]
    snapshot = (f'{{"birth_date":"{_birth_date(_digest(seed, PERSONS, n))}","document_mask":"{mask}",'
                f'"first_name":"First-{n:06d}","last_name":"Last-{n:06d}","request":{n}}}')
    return {"snapshot_cipher": snapshot.encode()}


_PLAINTEXTS: dict[str, Callable[[int, int, bytes | None], Plaintexts]] = {
    PERSONS: person_plaintexts,
    PERSON_DOCUMENTS: document_plaintexts,
    REQUISITE_TEMPLATES: template_plaintexts,
    VERIFICATION_REQUESTS: request_plaintexts,
}


def table_row_count(table: str, rows: int) -> int:
    """How many rows of ``table`` a seed of ``rows`` persons makes."""
    return {PERSONS: rows, PERSON_DOCUMENTS: rows // 2, REQUISITE_TEMPLATES: rows // 4,
            VERIFICATION_REQUESTS: rows // 4}[table]


def expected_plaintexts(*, rows: int, seed: int, first_row: int = 0) -> dict[str, dict[uuid.UUID, Plaintexts]]:
    """Per table, per row id: what each cipher column decrypts to (None: the column is NULL).

    Recomputed from ``seed`` and the row numbers: the seeder stores nothing. Meant for tests of a
    few thousand rows; a 200,000-row check is better done by decrypting before and after.
    """
    out: dict[str, dict[uuid.UUID, Plaintexts]] = {}
    for table in TABLES:
        make = _PLAINTEXTS[table]
        out[table] = {
            row_id(seed, table, n): make(seed, n, None)
            for n in range(first_row, first_row + table_row_count(table, rows))
        }
    return out


# -- seeding ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeedSummary:
    """What ``seed_pin_profile`` inserted. ``seed`` and ``first_row`` recompute every id and plaintext."""

    seed: int
    key_id: str
    first_row: int
    persons: int
    person_documents: int
    requisite_templates: int
    verification_requests: int
    drafts: int

    @property
    def counts(self) -> dict[str, int]:
        """Rows per qualified table name (``profile.persons``: n, ...)."""
        return {
            f"{SCHEMA}.{PERSONS}": self.persons,
            f"{SCHEMA}.{PERSON_DOCUMENTS}": self.person_documents,
            f"{SCHEMA}.{REQUISITE_TEMPLATES}": self.requisite_templates,
            f"{SCHEMA}.{VERIFICATION_REQUESTS}": self.verification_requests,
        }

    @property
    def total_rows(self) -> int:
        return sum(self.counts.values())

    def expected_plaintexts(self) -> dict[str, dict[uuid.UUID, Plaintexts]]:
        return expected_plaintexts(rows=self.persons, seed=self.seed, first_row=self.first_row)


class _FieldEncryptor:
    """Encrypts under one key into a ready binary-COPY field (NULL stays NULL).

    Nonces are random, drawn from the OS in bulk (one syscall per 4,096 values, never reused).
    """

    def __init__(self, keyring: Keyring, key_id: str) -> None:
        self._encrypt = AesGcmCipherSet(keyring).cipher(key_id).encrypt
        self._nonces = b""
        self._pos = 0

    def __call__(self, plaintext: bytes | None) -> bytes:
        if plaintext is None:
            return _NULL
        if self._pos >= len(self._nonces):
            self._nonces, self._pos = os.urandom(_NONCE_LEN * 4096), 0
        nonce = self._nonces[self._pos:self._pos + _NONCE_LEN]
        self._pos += _NONCE_LEN
        blob = self._encrypt(plaintext, nonce)
        return _pack_i(len(blob)) + blob


# PostgreSQL binary COPY, written by hand: psycopg's per-value dumpers cost 3x the encryption.
_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_COPY_TRAILER = struct.pack(">h", -1)
_NULL = struct.pack(">i", -1)
_pack_i = struct.Struct(">i").pack
_pack_q = struct.Struct(">q").pack
_pack_h = struct.Struct(">h").pack
_LEN4 = _pack_i(4)
_LEN8 = _pack_i(8)
_LEN16 = _pack_i(16)
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
_PG_EPOCH_DATE = dt.date(2000, 1, 1)
# Audit timestamps: _EPOCH + n minutes, in PostgreSQL's microseconds since 2000-01-01.
_AUDIT_BASE_US = int((_EPOCH - _PG_EPOCH).total_seconds()) * 1_000_000
_MINUTE_US = 60_000_000


def _f_bytes(value: bytes | None) -> bytes:
    return _NULL if value is None else _pack_i(len(value)) + value


def _f_text(value: str) -> bytes:
    raw = value.encode()
    return _pack_i(len(raw)) + raw


def _f_int4(value: int | None) -> bytes:
    return _NULL if value is None else _LEN4 + _pack_i(value)


def _f_uuid(raw: bytes) -> bytes:
    return _LEN16 + _uuid_bytes(raw)


def _f_timestamp_us(micros: int | None) -> bytes:
    return _NULL if micros is None else _LEN8 + _pack_q(micros)


_EXPIRY_BASE_DAYS = (dt.date(2030, 1, 1) - _PG_EPOCH_DATE).days  # expires_on: 2030-01-01 + n % 3650 days


def _scan_list(n: int) -> str:
    k = n % 3
    if k == 0:
        return "[]"
    if k == 1:
        return f'["scan-{n:06d}-0.jpg"]'
    return f'["scan-{n:06d}-0.jpg","scan-{n:06d}-1.jpg"]'


def _f_jsonb_text(text: str) -> bytes:
    return _f_bytes(b"\x01" + text.encode())  # jsonb binary format version 1, then the JSON text


# Clear, non-PII columns, pre-encoded.
_COUNTRIES = tuple(_f_int4(c) for c in (643, 398, 112, 51))
_GENDERS = tuple(_f_text(g) for g in ("F", "M"))
_COMPOSITIONS = tuple(_f_jsonb_text(_dumps({"fields": ["email", "phone"][:k]}).decode()) for k in range(3))


def seed_pin_profile(conn: psycopg.Connection[Any], keyring: Keyring, *, rows: int, key_id: str = "1",
                     seed: int | None = None, first_row: int = 0) -> SeedSummary:
    """Insert ``rows`` persons and their documents, templates and requests, all under ``key_id``.

    Row numbers run from ``first_row``: seed again with ``first_row`` past the previous range (and
    the same or another key) to add rows without id clashes. One transaction, binary COPY. The
    schema must exist (``apply_pin_profile_schema``). Counts: persons ``rows``, documents
    ``rows // 2``, templates and requests ``rows // 4`` each (a third of requests are drafts).
    """
    if rows < 0 or first_row < 0:
        raise ValueError("rows and first_row must be >= 0")
    if not is_version(key_id):
        raise ConfigError(f"seed: key {key_id} is not an integer key version (the preset is aesgcm)")
    seed = secrets.randbits(63) if seed is None else seed
    encrypt = _FieldEncryptor(keyring, key_id)  # KeyUnavailable when the keyring lacks key_id
    kv = _f_int4(int(key_id))
    hash_key = hashlib.sha256(f"pinrotate-preset-number-hash:{seed}".encode()).digest()
    ranges = {t: range(first_row, first_row + table_row_count(t, rows)) for t in TABLES}

    def audit(n: int, d: bytes) -> bytes:
        # Business version, updated_at, updated_by_user_id: distinct per row, so a test sees any change.
        return _f_int4(1 + n % 5) + _f_timestamp_us(_AUDIT_BASE_US + n * _MINUTE_US) + _LEN16 + d[48:64]

    def persons() -> Iterator[bytes]:
        for n in ranges[PERSONS]:
            d = _digest(seed, PERSONS, n)
            p = person_plaintexts(seed, n, d)
            yield b"".join((
                _f_uuid(d), _LEN16 + d[16:32],  # owner_user_id: random bits, no UUID version needed
                encrypt(p["first_name_cipher"]), encrypt(p["last_name_cipher"]),
                encrypt(p["middle_name_cipher"]), encrypt(p["birth_date_cipher"]),
                kv, _COUNTRIES[n % 4], _GENDERS[n % 2], audit(n, d),
            ))

    def documents() -> Iterator[bytes]:
        for n in ranges[PERSON_DOCUMENTS]:
            d = _digest(seed, PERSON_DOCUMENTS, n)
            number = _document_number(d)
            yield b"".join((
                _f_uuid(d), _f_uuid(_digest(seed, PERSONS, n)), _f_text(_DOC_TYPES[n % len(_DOC_TYPES)]),
                encrypt(document_plaintexts(seed, n, d)["payload_cipher"]),
                _f_bytes(hmac.digest(hash_key, number.encode(), "sha256")),
                _f_text("******" + number[-4:]), kv,
                _f_jsonb_text(_scan_list(n)), _LEN4 + _pack_i(_EXPIRY_BASE_DAYS + n % 3650), audit(n, d),
            ))

    def templates() -> Iterator[bytes]:
        for n in ranges[REQUISITE_TEMPLATES]:
            d = _digest(seed, REQUISITE_TEMPLATES, n)
            p = template_plaintexts(seed, n, d)
            yield b"".join((
                _f_uuid(d), _f_uuid(_digest(seed, PERSONS, n)), _f_text(f"Template {n}"),
                encrypt(p["contact_email_cipher"]), encrypt(p["contact_phone_cipher"]),
                kv, _COMPOSITIONS[n % 3], audit(n, d),
            ))

    def requests() -> Iterator[bytes]:
        for n in ranges[VERIFICATION_REQUESTS]:
            d = _digest(seed, VERIFICATION_REQUESTS, n)
            draft = is_draft(n)
            yield b"".join((
                _f_uuid(d), _f_uuid(_digest(seed, PERSONS, n)), _f_text("draft" if draft else "submitted"),
                _f_timestamp_us(None if draft else _AUDIT_BASE_US + n * _MINUTE_US + 30_000_000),
                encrypt(request_plaintexts(seed, n, d)["snapshot_cipher"]),
                _NULL if draft else kv, audit(n, d),
            ))

    audit_cols = ("version", "updated_at", "updated_by_user_id")
    plan: list[tuple[str, tuple[str, ...], Iterator[bytes]]] = [
        (PERSONS, ("id", "owner_user_id", *CIPHER_COLUMNS[PERSONS], "key_version", "citizenship_country_id",
                   "gender", *audit_cols), persons()),
        (PERSON_DOCUMENTS, ("id", "person_id", "document_type", "payload_cipher", "number_hash", "number_mask",
                            "key_version", "scan_list", "expires_on", *audit_cols), documents()),
        (REQUISITE_TEMPLATES, ("id", "person_id", "name", *CIPHER_COLUMNS[REQUISITE_TEMPLATES], "key_version",
                               "composition", *audit_cols), templates()),
        (VERIFICATION_REQUESTS, ("id", "person_id", "status", "submitted_at", "snapshot_cipher", "key_version",
                                 *audit_cols), requests()),
    ]
    with conn.transaction():
        for table, columns, encoded_rows in plan:
            _copy_binary(conn, table, columns, encoded_rows)

    return SeedSummary(
        seed=seed, key_id=key_id, first_row=first_row, persons=len(ranges[PERSONS]),
        person_documents=len(ranges[PERSON_DOCUMENTS]), requisite_templates=len(ranges[REQUISITE_TEMPLATES]),
        verification_requests=len(ranges[VERIFICATION_REQUESTS]),
        drafts=sum(1 for n in ranges[VERIFICATION_REQUESTS] if is_draft(n)),
    )


def _copy_binary(conn: psycopg.Connection[Any], table: str, columns: tuple[str, ...],
                 encoded_rows: Iterator[bytes]) -> None:
    """COPY pre-encoded binary tuples; each tuple is prefixed with its field count here."""
    stmt = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
        sql.Identifier(SCHEMA, table), sql.SQL(", ").join(sql.Identifier(c) for c in columns))
    field_count = _pack_h(len(columns))
    with conn.cursor() as cur, cur.copy(stmt) as copy:
        chunk = [_COPY_SIGNATURE]
        size = 0
        for row in encoded_rows:
            chunk.append(field_count)
            chunk.append(row)
            size += len(row)
            if size > 1 << 20:
                copy.write(b"".join(chunk))
                chunk, size = [], 0
        chunk.append(_COPY_TRAILER)
        copy.write(b"".join(chunk))
