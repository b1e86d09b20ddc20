"""How the discovery sweep reads one table: FPC1 / ``vault:v<N>:`` key ids by pattern (one scan, every key
at once, in the text form of every swept column) and JSON fields outside the configured paths. Binary
ciphertexts are tried value by value in ``sweep_trial``. Counts per key id only: no value leaves here.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import psycopg
from psycopg import sql

from ..engines.postgresql import sweep as pg_sweep
from ..schemes._json_paths import parse_json_path
from .sweep_plan import SweptTable

# A key id after any "FPC1:<algorithm>:" (algorithms beyond the two known ones too: fail closed), or a
# Transit version after "vault:v". Anywhere in a value: inside JSON documents, arrays, free text.
FPC1_FIND: Final = r"FPC1:[A-Za-z0-9-]{1,16}:([A-Za-z0-9_-]{1,32}):"
TRANSIT_FIND: Final = r"vault:v([0-9]{1,10}):"
FETCH_ROWS: Final = 5000


@dataclass(frozen=True)
class Find:
    """Values under held keys in one column: ``by_key`` counts values found by key id (pattern) or by
    trying the keys on every candidate value (trial: ``sampled`` is how many candidates were tried)."""

    column: str
    by_key: dict[str, int]
    method: Literal["pattern", "trial"]
    sampled: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"column": self.column, "by_key": dict(sorted(self.by_key.items())),
                               "method": self.method}
        if self.sampled is not None:
            out["tried"] = self.sampled
        return out


def _marker(server_side: bool) -> str:
    return "vault:v" if server_side else "FPC1:"


def pattern_counts(conn: psycopg.Connection[Any], table: SweptTable, server_side: bool) -> dict[str, Counter[str]]:
    """Values per key id in every pattern-swept column of ``table``: one sequential scan, every key at once
    (the PostgreSQL room's ``sweep.pattern_counts``)."""
    columns = [(c.name, c.kind == "bytea") for c in table.columns if not c.json_paths]
    return pg_sweep.pattern_counts(conn, table.relation, columns, _marker(server_side),
                                   TRANSIT_FIND if server_side else FPC1_FIND)


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
