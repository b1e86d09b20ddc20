"""The discovery sweep: ciphertexts under a held key outside the configured targets (issue 22, point 6).

The gate sees configured columns; an archive table, a copy in another schema or a JSON field outside
``json_paths`` can still hold values under KEY. The sweep looks at every other column of every table,
partition and materialized view of the database: text, JSON and bytea columns for FPC1 (local keyrings)
or ``vault:v<N>:`` (Transit) values by key id, one scan per table for every key at once; bytea and
base64 text columns by trying the held keys on a bounded sample. It reports names and counts, never a
value; it never writes.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Final, Literal

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ..config import Settings
from ..db import database_url, describe_db_error, make_engine, raw_connection
from ..errors import CiphertextInvalid, DatabaseError
from ..keyring import Keyring, is_version
from ..log import log_event
from ..providers import build_provider
from ..schemes._json_paths import parse_json_path
from ..schemes.aesgcm import AesGcmCipherSet, ColumnEncoding
from ..schemes.base import LEGACY_KEY
from ..schemes.fpc1 import LegacyCipher
from ..targets import relation_of
from .verdict import GateReport

# A key id after any "FPC1:<algorithm>:" (algorithms beyond the two known ones too: fail closed), or a
# Transit version after "vault:v". Anywhere in a value: inside JSON documents, arrays, free text.
FPC1_FIND: Final = r"FPC1:[A-Za-z0-9-]{1,16}:([A-Za-z0-9_-]{1,32}):"
TRANSIT_FIND: Final = r"vault:v([0-9]{1,10}):"
SKIPPED_SCHEMAS: Final = ("pg_catalog", "information_schema", "pg_toast", "pinrotate")
SAMPLE_MIN_BYTES: Final = 28  # nonce(12) + tag(16): the shortest aesgcm value
SAMPLE_MAX_BYTES: Final = 1 << 20  # a larger value is not tried (a document, not a PII field)
LOCK_TIMEOUT: Final = "5s"  # a table locked by DDL longer than this is reported unreadable: closed
FETCH_ROWS: Final = 5000
Kind = Literal["text", "json", "bytea"]


@dataclass(frozen=True)
class Find:
    """Values under held keys in one column: ``by_key`` counts values (pattern) or sampled values (sample)."""

    column: str
    by_key: dict[str, int]
    method: Literal["pattern", "sample"]
    sampled: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"column": self.column, "by_key": dict(sorted(self.by_key.items())),
                               "method": self.method}
        if self.sampled is not None:
            out["sampled"] = self.sampled
        return out


@dataclass
class Discovery:
    """What the sweep found, what it could not read (closes every gate), what it was told to skip."""

    server_side: bool
    finds: list[Find] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # schema.table -> one-line reason
    not_swept: dict[str, str] = field(default_factory=dict)  # schema.table[.column] -> why (never blocks)
    tables: int = 0
    columns: int = 0
    seconds: float = 0.0

    def blocks(self, found: str, key: str) -> bool:
        """Does a value on ``found`` keep ``key`` from being destroyed? Transit: retiring N retires every M <= N."""
        if self.server_side:
            return is_version(found) and is_version(key) and int(found) <= int(key)
        return found == key

    def on_key(self, key: str) -> list[Find]:
        return [f for f in self.finds if any(self.blocks(k, key) for k in f.by_key)]

    def blocking(self, key: str) -> dict[str, int]:
        outside = sum(n for f in self.finds for k, n in f.by_key.items() if self.blocks(k, key))
        return {"OUTSIDE_TARGETS": outside, "UNREADABLE": len(self.unreadable)}

    def as_dict(self, key: str | None = None) -> dict[str, Any]:
        """Every find (``key`` None: ``inventory --discover``), or the finds that block ``key``."""
        finds = self.finds if key is None else self.on_key(key)
        return {"discovered": [f.as_dict() for f in finds], "unreadable": dict(self.unreadable),
                "not_swept": dict(self.not_swept), "tables_swept": self.tables, "columns_swept": self.columns,
                "seconds": round(self.seconds, 3)}


def apply_discovery(report: GateReport, discovery: Discovery) -> None:
    """Close ``report`` on a find under its key or an unreadable table; keep the sweep's account in it."""
    for category, n in discovery.blocking(report.key).items():
        report.blocking[category] = report.blocking.get(category, 0) + n
        if n:
            report.open = False
    report.discovery = discovery.as_dict(report.key)


# -- what to sweep ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweptColumn:
    name: str
    kind: Kind
    array: bool
    json_paths: tuple[str, ...] = ()  # a configured json column: swept outside these paths only

    @property
    def sampled(self) -> bool:
        return not self.array and not self.json_paths and self.kind in ("text", "bytea")


@dataclass
class SweptTable:
    schema: str
    table: str
    est_rows: float
    columns: list[SweptColumn] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def relation(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.table)


@dataclass
class _Rel:
    oid: int
    schema: str
    table: str
    relkind: str
    populated: bool
    usage: bool
    select: bool
    row_security: bool
    est_rows: float
    columns: list[tuple[str, int, bool]] = field(default_factory=list)  # name, type oid, column SELECT


_CATALOG = """
SELECT c.oid, n.nspname::text, c.relname::text, c.relkind::text, c.relispopulated,
       has_schema_privilege(n.oid, 'USAGE'), has_table_privilege(c.oid, 'SELECT'),
       c.relkind = 'r' AND row_security_active(c.oid),
       CASE WHEN c.reltuples >= 0 THEN c.reltuples ELSE pg_relation_size(c.oid) / 100.0 END,
       a.attname::text, a.atttypid, has_column_privilege(c.oid, a.attnum, 'SELECT')
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
 WHERE c.relkind IN ('r', 'm', 'f') AND n.nspname <> ALL(%s) AND n.nspname !~ '^pg_(toast_)?temp_'
 ORDER BY 2, 3, a.attnum
"""


def _type_kinds(conn: psycopg.Connection[Any]) -> dict[int, tuple[Kind, bool]]:
    """Type oid -> (kind, is an array) for every type the sweep reads, domains resolved to their base."""
    rows = conn.execute("SELECT t.oid, t.typname::text, t.typtype::text, t.typcategory::text, t.typbasetype, "
                        "t.typelem, t.typnamespace = 'pg_catalog'::regnamespace FROM pg_type t "
                        "WHERE t.typtype IN ('b', 'd')").fetchall()
    types = {int(r[0]): r for r in rows}

    def kind(oid: int, depth: int = 0) -> tuple[Kind, bool] | None:
        row = types.get(oid)
        if row is None or depth > 16:
            return None
        _, name, typtype, category, base, elem, builtin = row
        if typtype == "d":
            return kind(int(base), depth + 1)
        if category == "A":
            inner = kind(int(elem), depth + 1)
            # Arrays of text or JSON are read as their text form; a bytea[] text is hex: not swept.
            return (inner[0], True) if inner and not inner[1] and inner[0] != "bytea" else None
        if builtin and name == "bytea":
            return "bytea", False
        if builtin and name in ("json", "jsonb"):
            return "json", False
        return ("text", False) if category == "S" else None

    out: dict[int, tuple[Kind, bool]] = {}
    for oid in types:
        found = kind(oid)
        if found is not None:
            out[oid] = found
    return out


def _configured(conn: psycopg.Connection[Any], settings: Settings) -> dict[tuple[int, str], tuple[str, ...]]:
    """(table oid, column) of every configured cipher column -> its json_paths (empty: the whole column)."""
    out: dict[tuple[int, str], tuple[str, ...]] = {}
    for t in settings.targets:
        row = conn.execute("SELECT to_regclass(%s)::oid", (relation_of(t).as_string(conn),)).fetchone()
        if row is None or row[0] is None:
            continue  # a missing table is BLOCKED in the inventory: the gate is closed anyway
        for column in t.columns:
            out[(int(row[0]), column)] = tuple(t.json_paths.get(column, ()))
    return out


def _ancestors(conn: psycopg.Connection[Any]) -> dict[int, list[int]]:
    """Every relation's parents (partitions and inheritance children are read through their parents)."""
    parents: dict[int, list[int]] = {}
    for child, parent in conn.execute("SELECT inhrelid, inhparent FROM pg_inherits").fetchall():
        parents.setdefault(int(child), []).append(int(parent))
    return parents


def _lineage(oid: int, parents: dict[int, list[int]]) -> Iterator[int]:
    seen: set[int] = set()
    todo = [oid]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            yield current
            todo.extend(parents.get(current, []))


def plan_sweep(conn: psycopg.Connection[Any], settings: Settings, discovery: Discovery) -> list[SweptTable]:
    """The tables and columns to sweep; fills ``discovery.not_swept`` and ``discovery.unreadable``.

    A table the role cannot read in full (no USAGE on its schema, no SELECT on a swept column, row-level
    security that applies to the role) is unreadable: something could hide there, every gate stays closed.
    """
    kinds = _type_kinds(conn)
    configured = _configured(conn, settings)
    parents = _ancestors(conn)
    skip = settings.gate.discover_skip
    rels: dict[int, _Rel] = {}
    for (oid, schema, table, relkind, populated, usage, select, rls, est, column, typid,
         column_select) in conn.execute(_CATALOG, (list(SKIPPED_SCHEMAS),)).fetchall():
        rel = rels.get(int(oid))
        if rel is None:
            rel = rels[int(oid)] = _Rel(int(oid), schema, table, relkind, bool(populated), bool(usage),
                                        bool(select), bool(rls), float(est))
        rel.columns.append((column, int(typid), bool(column_select)))
    tables: list[SweptTable] = []
    for rel in rels.values():
        swept = SweptTable(rel.schema, rel.table, rel.est_rows)
        if any(fnmatchcase(swept.label, p) for p in skip if p.count(".") == 1):
            if any(int(typid) in kinds for _, typid, _ in rel.columns):
                discovery.not_swept[swept.label] = "[gate] discover_skip"
            continue
        lineage = list(_lineage(rel.oid, parents))
        unreadable_columns = False
        for name, typid, column_select in rel.columns:
            found = kinds.get(typid)
            if found is None:
                continue
            paths: tuple[str, ...] = ()
            covered = [configured[(o, name)] for o in lineage if (o, name) in configured]
            if covered:
                paths = covered[0]
                if not paths:
                    continue  # a configured cipher column: the inventory counts it
            label = f"{swept.label}.{name}"
            if any(fnmatchcase(label, p) for p in skip if p.count(".") == 2):
                discovery.not_swept[label] = "[gate] discover_skip"
                continue
            unreadable_columns |= not (rel.select or column_select)
            swept.columns.append(SweptColumn(name, found[0], found[1], paths))
        if not swept.columns:
            continue
        if rel.relkind == "f":
            discovery.not_swept[swept.label] = "foreign table: its rows live on another server, not swept"
        elif rel.relkind == "m" and not rel.populated:
            discovery.not_swept[swept.label] = "materialized view not populated: it holds no rows"
        elif not rel.usage or unreadable_columns:
            discovery.unreadable[swept.label] = (f"cannot read {swept.label}: the sweep cannot see it; "
                                                 "grant SELECT or list it in [gate] discover_skip")
        elif rel.row_security:
            discovery.unreadable[swept.label] = (f"cannot read every row of {swept.label}: row-level security "
                                                 "applies to this role; use a role with BYPASSRLS or list it "
                                                 "in [gate] discover_skip")
        else:
            tables.append(swept)
    return tables


# -- how --------------------------------------------------------------------------------------------------


def _marker(server_side: bool) -> str:
    return "vault:v" if server_side else "FPC1:"


def pattern_counts(conn: psycopg.Connection[Any], table: SweptTable, server_side: bool) -> dict[str, Counter[str]]:
    """Values per key id in every pattern-swept column of ``table``: one sequential scan, every key at once."""
    columns = [c for c in table.columns if not c.json_paths]
    if not columns:
        return {}
    marker = _marker(server_side)
    values = []
    for i, column in enumerate(columns):
        ref = sql.Identifier("t", column.name)
        if column.kind == "bytea":
            # Only values holding the marker's bytes are turned into text (escape keeps ASCII as it is).
            text = sql.SQL("CASE WHEN position({m} IN {c}) > 0 THEN encode({c}, 'escape') END").format(
                m=sql.Literal(marker.encode("ascii")), c=ref)
        else:
            text = sql.SQL("{}::text").format(ref)
        values.append(sql.SQL("({}, {})").format(sql.Literal(i), text))
    query = sql.SQL(
        "SELECT s.i, m[1], count(*) FROM (SELECT v.i, v.txt FROM ONLY {rel} AS t "
        "CROSS JOIN LATERAL (VALUES {values}) AS v(i, txt) WHERE strpos(v.txt, {marker}) > 0) AS s "
        "CROSS JOIN LATERAL regexp_matches(s.txt, {pattern}, 'g') AS m GROUP BY 1, 2"
    ).format(rel=table.relation, values=sql.SQL(", ").join(values), marker=sql.Literal(marker),
             pattern=sql.Literal(TRANSIT_FIND if server_side else FPC1_FIND))
    out: dict[str, Counter[str]] = {}
    for i, key, n in conn.execute(query).fetchall():
        out.setdefault(columns[int(i)].name, Counter())[str(key)] += int(n)
    return out


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as all its members in order (duplicates kept: the sweep must see every copy)."""


def _strip_paths(document: Any, paths: tuple[str, ...]) -> set[tuple[int, int]]:
    """The (container, position) of the string at each configured path, as the inventory reads it
    (json.loads: the last of duplicate members); those values are the target's, counted there."""
    taken: set[tuple[int, int]] = set()
    for path in paths:
        node, where = document, None
        for step in parse_json_path(path).steps:
            if isinstance(step, str) and isinstance(node, _Pairs):
                hits = [i for i, (name, _) in enumerate(node) if name == step]
                where, node = ((id(node), hits[-1]), node[hits[-1]][1]) if hits else (None, None)
            elif isinstance(step, int) and isinstance(node, list) and not isinstance(node, _Pairs) \
                    and step < len(node):
                where, node = (id(node), step), node[step]
            else:
                where = None
                break
        if where is not None and isinstance(node, str):
            taken.add(where)
    return taken


def _strings(node: Any, taken: set[tuple[int, int]]) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, _Pairs):
        for i, (name, value) in enumerate(node):
            yield name
            if (id(node), i) not in taken:
                yield from _strings(value, taken)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if (id(node), i) not in taken:
                yield from _strings(value, taken)


def outside_paths(text: str, paths: tuple[str, ...], pattern: re.Pattern[str]) -> Counter[str]:
    """Key ids of the values in a JSON document outside its configured ``paths`` (JSON escapes decoded).

    A document that does not parse is searched whole (the inventory counts it UNKNOWN anyway)."""
    try:
        document = json.loads(text, object_pairs_hook=_Pairs)
    except (json.JSONDecodeError, RecursionError):
        return Counter(pattern.findall(text))
    taken = _strip_paths(document, paths)
    return Counter(key for s in _strings(document, taken) for key in pattern.findall(s))


def json_path_counts(conn: psycopg.Connection[Any], table: SweptTable, server_side: bool) -> dict[str, Counter[str]]:
    """Values per key id outside the configured paths of ``table``'s configured json columns (read in Python:
    duplicate members and ``\\u`` escapes are seen as the application's parser sees them)."""
    pattern = re.compile(TRANSIT_FIND if server_side else FPC1_FIND)
    out: dict[str, Counter[str]] = {}
    for column in (c for c in table.columns if c.json_paths):
        ref = sql.Identifier(column.name)
        query = sql.SQL("SELECT {c}::text FROM ONLY {rel} WHERE strpos({c}::text, {m}) > 0 OR strpos({c}::text, {u}) > 0"
                        ).format(c=ref, rel=table.relation, m=sql.Literal(_marker(server_side)), u=sql.Literal("\\u"))
        counts: Counter[str] = Counter()
        with conn.transaction(), conn.cursor(name="pinrotate_discover") as cur:
            cur.itersize = FETCH_ROWS
            cur.execute(query)
            for (text,) in cur:
                counts.update(outside_paths(str(text), column.json_paths, pattern))
        if counts:
            out[column.name] = counts
    return out


class SampleKeys:
    """Tries the keyring's local keys (and an ``aesgcm-b64`` legacy key) on sampled values."""

    def __init__(self, keyring: Keyring, legacy_format: str) -> None:
        self.ciphers = AesGcmCipherSet(keyring)
        self.ids = keyring.ids()
        self.legacy = (LegacyCipher(keyring.legacy, "aesgcm-b64")
                       if keyring.legacy is not None and legacy_format == "aesgcm-b64" else None)

    def key_of(self, blob: bytes) -> str | None:
        for key_id in self.ids:
            try:
                self.ciphers.decrypt(key_id, blob)
                return key_id
            except CiphertextInvalid:
                continue
        if self.legacy is not None:
            try:
                self.legacy.decrypt_blob(blob)
                return LEGACY_KEY
            except CiphertextInvalid:
                pass
        return None


def sample_finds(conn: psycopg.Connection[Any], table: SweptTable, keys: SampleKeys, per_column: int) -> list[Find]:
    """Try every held key on up to ``per_column`` candidate values of each bytea / text column of ``table``:
    random pages (TABLESAMPLE SYSTEM) of a large table, its first rows when small or the pages gave little."""
    columns = [c for c in table.columns if c.sampled]
    if not columns:
        return []
    exprs = []
    for column in columns:
        c = sql.Identifier(column.name)
        if column.kind == "bytea":
            exprs.append(sql.SQL("CASE WHEN octet_length({c}) BETWEEN {lo} AND {hi} THEN {c} END").format(
                c=c, lo=sql.Literal(SAMPLE_MIN_BYTES), hi=sql.Literal(SAMPLE_MAX_BYTES)))
        else:  # standard base64 with padding of at least nonce and tag
            exprs.append(sql.SQL("CASE WHEN octet_length({c}::text) BETWEEN 40 AND {hi} AND {c}::text ~ "
                                 "'^([A-Za-z0-9+/]{{4}})*([A-Za-z0-9+/]{{2}}==|[A-Za-z0-9+/]{{3}}=)?$' "
                                 "THEN {c}::text END").format(c=c, hi=sql.Literal(SAMPLE_MAX_BYTES * 4 // 3 + 4)))
    rows_wanted = per_column * 4
    select = sql.SQL("SELECT {} FROM ONLY {} AS t").format(sql.SQL(", ").join(exprs), table.relation)
    rows: list[tuple[Any, ...]] = []
    if table.est_rows > rows_wanted * 4:
        percent = min(100.0, 100.0 * 2 * rows_wanted / table.est_rows)
        rows = conn.execute(sql.SQL("{} TABLESAMPLE SYSTEM ({}) LIMIT {}").format(
            select, sql.Literal(percent), sql.Literal(rows_wanted))).fetchall()
    if len(rows) < rows_wanted // 4:
        rows += conn.execute(sql.SQL("{} LIMIT {}").format(select, sql.Literal(rows_wanted))).fetchall()
    finds = []
    for j, column in enumerate(columns):
        candidates = [row[j] for row in rows if row[j] is not None][:per_column]
        by_key: Counter[str] = Counter()
        for stored in candidates:
            if column.kind == "bytea":
                blob = bytes(stored)
            else:
                try:
                    blob = ColumnEncoding.BASE64_TEXT.to_bytes(stored)
                except CiphertextInvalid:
                    continue
            key = keys.key_of(blob)
            if key is not None:
                by_key[key] += 1
        if by_key:
            finds.append(Find(f"{table.label}.{column.name}", dict(by_key), "sample", sampled=len(candidates)))
    return finds


# -- the sweep ---------------------------------------------------------------------------------------------


def sweep_database(conn: psycopg.Connection[Any], settings: Settings, keyring: Keyring) -> Discovery:
    """Sweep the database behind ``conn`` (autocommit: each table is read, and locked, on its own).

    A table dropped meanwhile is gone (nothing to find); one locked by DDL past ``LOCK_TIMEOUT``, or one the
    role turns out not to read, is unreadable (closes every gate). Other database errors: DatabaseError.
    """
    started = time.monotonic()
    discovery = Discovery(server_side=keyring.server_side)
    keys = None if keyring.server_side else SampleKeys(keyring, settings.keys.legacy_format)
    try:
        conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
        tables = plan_sweep(conn, settings, discovery)
        for table in tables:
            try:
                found = pattern_counts(conn, table, keyring.server_side)
                found.update(json_path_counts(conn, table, keyring.server_side))
                discovery.finds += [Find(f"{table.label}.{name}", dict(counts), "pattern")
                                    for name, counts in found.items()]
                if keys is not None:
                    discovery.finds += sample_finds(conn, table, keys, settings.gate.discover_sample)
            except psycopg.errors.UndefinedTable:
                continue
            except (psycopg.errors.LockNotAvailable, psycopg.errors.InsufficientPrivilege) as e:
                discovery.unreadable[table.label] = (f"cannot read {table.label} ({describe_db_error(e)}): the sweep "
                                                     "cannot see it; grant SELECT or list it in [gate] discover_skip")
                continue
            discovery.tables += 1
            discovery.columns += len(table.columns)
        conn.execute("RESET lock_timeout")
    except psycopg.Error as e:
        raise DatabaseError(f"the sweep outside the targets failed ({describe_db_error(e)})") from None
    discovery.seconds = time.monotonic() - started
    return discovery


def discover_outside_targets(engine: sa.Engine, settings: Settings, keyring: Keyring) -> Discovery:
    """The sweep on a connection of its own (its lock_timeout ends with it)."""
    with raw_connection(engine) as conn:
        return sweep_database(conn, settings, keyring)


def discover(settings: Settings) -> Discovery:
    """``inventory --discover``: the sweep with the configured keyring and database."""
    keyring = build_provider(settings).load_keyring()
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        return discover_outside_targets(engine, settings, keyring)
    finally:
        engine.dispose()


def sweep_for_run(engine: sa.Engine, settings: Settings, keyring: Keyring, verdicts: Mapping[str, GateReport],
                  run_id: str) -> None:
    """The run's gate: one sweep for every older key at once, only when some key would otherwise be open
    (the sweep can only close a gate). A sweep that fails closes every key, with the reason logged."""
    if not any(report.open for report in verdicts.values()):
        return
    try:
        discovery = discover_outside_targets(engine, settings, keyring)
    except DatabaseError as e:
        log_event("gate_sweep_failed", level=40, run_id=run_id, error=str(e))
        for report in verdicts.values():
            report.open = False
            report.blocking["UNSWEPT"] = 1
        return
    for report in verdicts.values():
        apply_discovery(report, discovery)


def outside_targets(report: GateReport) -> dict[str, list[str]]:
    """For the run's gate entry of a key: the columns holding values under it and the unreadable tables."""
    names = [f["column"] for f in report.discovery.get("discovered", [])]
    names += list(report.discovery.get("unreadable", {}))
    return {"outside_targets": names} if names else {}
