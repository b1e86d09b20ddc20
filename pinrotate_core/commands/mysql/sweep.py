"""The gate's sweep outside the configured targets on MySQL / MariaDB (contract §6, OUTSIDE_TARGETS,
UNREADABLE, UNSWEPT), inside the gate's consistent snapshot.

Every text, JSON or binary column of every base table of every database the server shows the role
(system schemas aside: ``engines/mysql/gate.py``), minus the configured targets' cipher columns and
what ``[gate] discover_skip`` vouches for, is read completely:

- FPC1 / ``vault:v<N>:`` key ids by pattern (the room streams the values holding the marker; the
  same regular expressions as on PostgreSQL count them in Python, every key at once);
- binary ciphertexts by trying the keys on every value and on every base64 / hex token of a text
  value (``gate.sweep_trial.TrialKeys``, the same as on PostgreSQL).

A target's JSON column is searched outside its configured ``json_paths`` (``gate.sweep_reads.outside_paths``,
in Python, as on PostgreSQL: JSON escapes decoded).

Fail closed: a column the role cannot read is UNREADABLE; a table outside the snapshot (MyISAM,
Aria, MEMORY) and, when the role lacks a global SELECT, the tables ``information_schema`` hides from
it are UNSWEPT; a table that fails to read is UNREADABLE. Counts and names only, never a value. ``inventory --discover``
runs the same sweep in a snapshot of its own (``discover_mysql``).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Collection, Sequence
from fnmatch import fnmatchcase
from itertools import groupby

from ...config import Settings
from ...db import database_url, make_engine
from ...engines.base.checks import CandidateColumn
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql.connect import MySqlConnection
from ...engines.mysql.gate import GATE_CHECKS
from ...engines.mysql.sweep import stream_values
from ...errors import DatabaseError
from ...forge_discovery import with_forge_targets
from ...gate.discover import Discovery
from ...gate.sweep_reads import FPC1_FIND, TRANSIT_FIND, Find, outside_paths
from ...gate.sweep_trial import TOKEN, TrialKeys
from ...keyring import Keyring
from ...providers import build_provider

_TOKENS = re.compile(TOKEN.encode("ascii"))


def _current_database(conn: MySqlConnection) -> str:
    with conn.cursor() as cur:
        cur.execute("SELECT DATABASE()", ())
        row = cur.fetchone()
    return str(row[0]) if row and row[0] is not None else ""


def _skipped(table: str, column: str | None, globs: Sequence[str]) -> str | None:
    """What ``[gate] discover_skip`` leaves out, named as on PostgreSQL (``gate.sweep_plan``): the
    table when a ``schema.table`` glob names it, else the column when a ``schema.table.column`` one does."""
    if any(fnmatchcase(table, glob) for glob in globs if glob.count(".") == 1):
        return table
    label = f"{table}.{column}"
    if column is not None and any(fnmatchcase(label, glob) for glob in globs if glob.count(".") == 2):
        return label
    return None


def sweep_mysql(conn: MySqlConnection, settings: Settings, keyring: Keyring,
                key_ids: Sequence[str] | None = None,
                tables_before: Collection[tuple[str, str]] = ()) -> Discovery:
    """The sweep on ``conn``, which must be inside the gate's snapshot (``GATE_CHECKS.snapshot``).
    ``tables_before``: ``GATE_CHECKS.candidate_tables`` read right before the snapshot began; one of
    them the catalog no longer shows was dropped or renamed since, its rows at the snapshot unread:
    UNREADABLE, never nothing there (a renamed one is also read under its new name)."""
    started = time.monotonic()
    out = Discovery(server_side=keyring.server_side)
    here = _current_database(conn)
    configured: set[tuple[str, str, str]] = set()
    json_paths: dict[tuple[str, str, str], tuple[str, ...] | None] = {}  # None: a target takes the whole column
    for t in settings.targets:
        schema = t.schema_name or here
        for c in t.columns:
            where = (schema, t.table_name, c)
            paths = t.json_paths.get(c)
            if paths is None or json_paths.get(where, ()) is None:
                json_paths[where] = None
            else:
                json_paths[where] = (*(json_paths.get(where) or ()), *paths)
            configured.add(where)
    if not GATE_CHECKS.sees_every_table(conn):
        out.unswept["tables hidden from this role"] = ("information_schema shows only the tables the role holds a "
                                                       "privilege on: GRANT SELECT ON *.* to the gate's role")
    candidates: list[CandidateColumn] = []
    columns_now = GATE_CHECKS.candidate_columns(conn)
    for schema, table in sorted(set(tables_before) - {(c.schema, c.table) for c in columns_now}):
        label = f"{schema}.{table}"
        if _skipped(label, None, settings.gate.discover_skip) is not None:
            out.not_swept[label] = "[gate] discover_skip"
        else:
            out.unreadable[label] = ("dropped or renamed after the gate's snapshot began: what it held then was not "
                                     "read; look again")
    for column in columns_now:
        if (column.schema, column.table, column.column) in configured:
            continue
        table = f"{column.schema}.{column.table}"
        skipped = _skipped(table, column.column, settings.gate.discover_skip)
        if skipped is not None:
            out.not_swept[skipped] = "[gate] discover_skip"
        elif not column.readable:
            out.unreadable[column.label] = "the role may not SELECT it"
        elif not column.transactional:
            out.unswept[table] = "not an InnoDB table: outside the gate's consistent snapshot"
        else:
            candidates.append(column)
    keys = None if keyring.server_side else TrialKeys(keyring, key_ids)
    marker = "vault:v" if keyring.server_side else "FPC1:"
    pattern = re.compile(TRANSIT_FIND if keyring.server_side else FPC1_FIND)
    for (schema, table, name), paths in json_paths.items():
        if paths is not None:
            column = CandidateColumn(schema, table, name, "json", binary=False, readable=True)
            try:
                found = _outside_paths(conn, column, paths, marker, pattern)
            except DatabaseError as e:
                out.unreadable[column.label] = str(e)
                continue
            if found:
                out.finds.append(Find(column.label, dict(found), "pattern"))
    for (schema, table), group in groupby(candidates, key=lambda c: (c.schema, c.table)):
        columns = list(group)
        try:
            out.finds += _table_finds(conn, columns, marker, pattern, keys)
        except DatabaseError as e:
            out.unreadable[f"{schema}.{table}"] = str(e)
            continue
        out.tables += 1
        out.columns += len(columns)
    out.seconds = time.monotonic() - started
    return out


def discover_mysql(settings: Settings) -> Discovery:
    """``inventory --discover`` on MySQL / MariaDB: the gate's sweep, in a consistent snapshot of
    its own, with every key of the configured keyring (``gate.discover.discover`` on PostgreSQL)."""
    keyring = build_provider(settings).load_keyring()
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        settings = with_forge_targets(settings, engine)  # Forge's own tables are targets, not finds
        with mysql_connect.raw_connection(engine) as conn:
            before = GATE_CHECKS.candidate_tables(conn)
            with GATE_CHECKS.snapshot(conn):
                return sweep_mysql(conn, settings, keyring, tables_before=before)
    finally:
        engine.dispose()


def _outside_paths(conn: MySqlConnection, column: CandidateColumn, paths: tuple[str, ...], marker: str,
                   pattern: re.Pattern[str]) -> Counter[str]:
    """Key ids of a configured JSON column's values outside ``paths`` (a marker written with a ``\\u``
    escape too: every value holding either is parsed)."""
    counts: Counter[str] = Counter()
    for _, value in stream_values(conn, [column]):
        text = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
        if marker in text or "\\u" in text:
            counts.update(outside_paths(text, paths, pattern))
    return counts


def _table_finds(conn: MySqlConnection, columns: list[CandidateColumn], marker: str, pattern: re.Pattern[str],
                 keys: TrialKeys | None) -> list[Find]:
    by_pattern = [Counter[str]() for _ in columns]
    by_trial = [Counter[str]() for _ in columns]
    tried = [0] * len(columns)
    if keys:  # every value: the pattern and the keys in one scan
        values = stream_values(conn, columns)
    else:
        values = stream_values(conn, columns, marker)
    for i, value in values:
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        if marker in text:
            by_pattern[i].update(pattern.findall(text))
            continue
        if not keys:
            continue
        raw = value if isinstance(value, bytes) else value.encode("utf-8")
        candidates = [raw] if columns[i].binary else [raw, *(tok for tok in _TOKENS.findall(raw) if tok != raw)]
        for candidate in candidates:
            if len(candidate) < min(keys.min_bytes, keys.min_text):
                continue
            tried[i] += 1
            key = keys.key_of_value(candidate)
            if key is not None:
                by_trial[i][key] += 1
                break
    finds: list[Find] = []
    for i, column in enumerate(columns):
        if by_pattern[i]:
            finds.append(Find(column.label, dict(by_pattern[i]), "pattern"))
        if by_trial[i]:
            finds.append(Find(column.label, dict(by_trial[i]), "trial", sampled=tried[i]))
    return finds
