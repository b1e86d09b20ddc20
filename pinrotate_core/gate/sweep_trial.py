"""Binary ciphertexts outside the targets: EVERY candidate value tried with every key the verdict concerns.

A binary ciphertext (``aesgcm``: nonce || ciphertext || tag; a headerless Forge legacy value, SM4 or AES in
ECB) names no key:
the only way to know it is under KEY is to try KEY on it. Nothing is sampled. To stay fast the database
keeps only values of a ciphertext's length and shape (SQL prefilter), rows come in binary, and each value
is normalised to the encodings programs actually store (raw bytes, base64 standard or url-safe, padded or
not, MIME line-wrapped, hex with or without ``\\x``, any of those as text inside a bytea) and tried in a
tight loop of AEAD calls (``cryptography``). Containers (arrays, composites, ranges, xml, hstore, json) are
tried token by token: every base64 / hex run of their text form. Counts per key only: no value leaves here.
"""

from __future__ import annotations

import binascii
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import psycopg
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from psycopg import sql

from .._primitives import EcbPkcs7
from ..errors import CiphertextInvalid
from ..keyring import Keyring
from ..schemes.base import LEGACY_KEY
from ..schemes.fpc1_values import decrypt_text
from .sweep_plan import SweptColumn, SweptTable
from .sweep_reads import Find

NONCE: Final = 12
MIN_BYTES: Final = 28  # nonce(12) + tag(16): the shortest aesgcm value
MIN_TEXT: Final = 38  # the shortest text form of 28 bytes (unpadded base64)
LEGACY_MIN_BYTES: Final = 16  # one ECB block: the shortest Forge legacy value
LEGACY_MIN_TEXT: Final = 22  # the shortest text form of 16 bytes (unpadded base64)
FETCH_ROWS: Final = 5000
# A token of a container's text form that could be an encoded ciphertext (base64 either alphabet, hex).
TOKEN: Final = r"[A-Za-z0-9+/_-]{38,}={0,2}"
_B64: Final = re.compile(rb"[A-Za-z0-9+/]+={0,2}")
_B64URL: Final = re.compile(rb"[A-Za-z0-9_-]+={0,2}")
_HEX: Final = re.compile(rb"(?:\\x|x)?([0-9A-Fa-f]+)")
_SPACE: Final = re.compile(rb"\s+")


def decodings(value: bytes, min_text: int = MIN_TEXT) -> Iterator[bytes]:
    """The byte strings ``value`` may stand for: its base64 / hex decodings when it is text (``value`` itself
    is tried first, by ``TrialKeys.key_of_value``)."""
    if not value.isascii():  # raw binary (the common case of a bytea): no text form to decode
        return
    text = _SPACE.sub(b"", value) if any(c in value for c in b" \t\r\n") else value
    if len(text) < min_text:
        return
    hexed = _HEX.fullmatch(text)
    if hexed is not None and len(hexed.group(1)) % 2 == 0:
        yield binascii.unhexlify(hexed.group(1))
    if _B64.fullmatch(text):
        body = text.rstrip(b"=")
        try:
            yield binascii.a2b_base64(body + b"=" * (-len(body) % 4))
        except binascii.Error:
            pass
    elif _B64URL.fullmatch(text):
        body = text.rstrip(b"=").translate(bytes.maketrans(b"-_", b"+/"))
        try:
            yield binascii.a2b_base64(body + b"=" * (-len(body) % 4))
        except binascii.Error:
            pass


class TrialKeys:
    """The keys to try: ``aesgcm`` AEADs of the given key ids, and the legacy key as Forge's SM4 and AES
    legacy values (ECB: a find needs valid padding and UTF-8 text, which random bytes almost never give)."""

    def __init__(self, keyring: Keyring, key_ids: Sequence[str] | None = None) -> None:
        ids = [k for k in keyring.ids() if key_ids is None or k in key_ids]
        self.aeads = [(k, AESGCM(keyring.keys[k].material)) for k in ids
                      if len(keyring.keys[k].material) in (16, 24, 32)]
        self.legacy: list[EcbPkcs7] = []
        if (key_ids is None or LEGACY_KEY in key_ids) and keyring.legacy is not None:
            material = keyring.legacy.material
            self.legacy = ([EcbPkcs7("AES", material)] if len(material) in (16, 24, 32) else []) + (
                [EcbPkcs7("SM4", material)] if len(material) == 16 else [])
        # The shortest value worth trying: a legacy value may be one ECB block.
        self.min_bytes, self.min_text = (LEGACY_MIN_BYTES, LEGACY_MIN_TEXT) if self.legacy else (MIN_BYTES, MIN_TEXT)

    def __bool__(self) -> bool:
        return bool(self.aeads) or bool(self.legacy)

    def key_of(self, blob: bytes) -> str | None:
        if len(blob) >= MIN_BYTES:
            nonce, body = blob[:NONCE], blob[NONCE:]
            for key_id, aead in self.aeads:
                try:
                    aead.decrypt(nonce, body, None)
                    return key_id
                except InvalidTag:
                    continue
        if self.legacy and len(blob) % 16 == 0:
            for cipher in self.legacy:
                try:
                    decrypt_text(cipher, blob)
                    return LEGACY_KEY
                except CiphertextInvalid:
                    continue
        return None

    def key_of_value(self, value: bytes) -> str | None:
        key = self.key_of(value)
        if key is not None or not value.isascii():  # raw binary: nothing more to decode (the common case)
            return key
        for blob in decodings(value, self.min_text):
            key = self.key_of(blob)
            if key is not None:
                return key
        return None


def _candidate(column: SweptColumn, keys: TrialKeys) -> sql.Composable:
    """The column's candidates in SQL: the value (scalars) or its tokens (containers); NULL when none."""
    c = sql.Identifier("t", column.name)
    if column.kind == "bytea" and not column.array:
        return sql.SQL("CASE WHEN octet_length({c}) >= {n} THEN {c} END").format(c=c, n=sql.Literal(keys.min_bytes))
    if column.kind == "text" and not column.array:
        return sql.SQL("CASE WHEN octet_length({c}::text) >= {n} AND {c}::text ~ {shape} "
                       "THEN convert_to({c}::text, 'UTF8') END").format(
            c=c, n=sql.Literal(keys.min_text), shape=sql.Literal(r"^(\\x)?[A-Za-z0-9+/=_[:space:]-]+$"))
    # A container's text form: its tokens are cut out in Python (re, C speed; cheaper than SQL regexps).
    return sql.SQL("CASE WHEN octet_length({c}::text) >= {n} THEN convert_to({c}::text, 'UTF8') END").format(
        c=c, n=sql.Literal(MIN_TEXT))


_TOKENS: Final = re.compile(TOKEN.encode("ascii"))


def _values(column: SweptColumn) -> Callable[[Any], Iterable[bytes]]:
    """What one fetched cell gives to try: the value itself (scalars), every token (containers)."""
    if column.kind in ("bytea", "text") and not column.array:
        return lambda value: () if value is None else (value if isinstance(value, bytes) else bytes(value),)
    return lambda value: () if value is None else _TOKENS.findall(value)


def trial_finds(conn: psycopg.Connection[Any], table: SweptTable, keys: TrialKeys) -> list[Find]:
    """Try ``keys`` on every candidate value of ``table``'s columns (one scan, binary); finds per column."""
    columns = [c for c in table.columns if c.tried]
    if not columns or not keys:
        return []
    exprs = [_candidate(c, keys) for c in columns]
    cells = [_values(c) for c in columns]
    where = sql.SQL(" OR ").join(sql.SQL("({}) IS NOT NULL").format(e) for e in exprs)
    query = sql.SQL("SELECT {} FROM ONLY {} AS t WHERE {}").format(sql.SQL(", ").join(exprs), table.relation, where)
    found = [Counter[str]() for _ in columns]
    tried = [0] * len(columns)
    with conn.transaction(), conn.cursor(name="pinrotate_trial", binary=True) as cur:
        cur.itersize = FETCH_ROWS
        cur.execute(query)
        while rows := cur.fetchmany(FETCH_ROWS):
            for row in rows:
                for j, value in enumerate(row):
                    for candidate in cells[j](value):
                        tried[j] += 1
                        key = keys.key_of_value(candidate)
                        if key is not None:
                            found[j][key] += 1
    return [Find(f"{table.label}.{column.name}", dict(found[j]), "trial", sampled=tried[j])
            for j, column in enumerate(columns) if found[j]]


def large_object_finds(conn: psycopg.Connection[Any], keys: TrialKeys | None, pattern: re.Pattern[bytes],
                       unreadable: dict[str, str]) -> list[Find]:
    """Every large object (``pg_largeobject_metadata``): key ids by pattern, and the whole object tried with
    the keys. One the role may not read is UNREADABLE (named by its oid)."""
    by_key: Counter[str] = Counter()
    count = 0
    for (oid,) in conn.execute("SELECT oid FROM pg_largeobject_metadata ORDER BY oid").fetchall():
        try:
            with conn.transaction():
                row = conn.execute("SELECT lo_get(%s)", (oid,)).fetchone()
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedObject) as e:
            unreadable[f"large object {oid}"] = f"cannot read large object {oid} ({type(e).__name__}): grant SELECT on it"
            continue
        data = bytes(row[0]) if row and row[0] is not None else b""
        count += 1
        by_key.update(m.decode("ascii") for m in pattern.findall(data))
        if keys:
            key = keys.key_of_value(data)
            if key is not None:
                by_key[key] += 1
    return [Find("pg_largeobject", dict(by_key), "trial", sampled=count)] if by_key else []
