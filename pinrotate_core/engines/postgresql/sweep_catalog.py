"""The PostgreSQL catalog as the gate's discovery sweep reads it: every table, partition, materialized
view and foreign table outside the system schemas with its columns and what the role may read of it
(schema USAGE, table and column SELECT, row-level security), the types whose values can carry a
ciphertext, the inheritance tree (partitions are read through their parents), the configured cipher
columns by oid, and whose another session's temporary table is. Catalog reads only; the rules over
them (UNREADABLE, UNSWEPT, ``discover_skip``) stay with the gate (``gate/sweep_plan.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import psycopg

# A configured target as the catalog needs it: its relation as SQL text, its cipher columns, and the
# json_paths of those holding ciphertexts inside JSON.
ConfiguredTarget = tuple[str, Sequence[str], Mapping[str, Sequence[str]]]

SKIPPED_SCHEMAS: Final = ("pg_catalog", "information_schema", "pg_toast", "pinrotate")
Kind = Literal["text", "json", "bytea", "container"]
# Type categories whose values cannot carry a ciphertext: numbers (oids too), booleans, date/time,
# network addresses, geometry, bit strings, enums (labels are fixed by DDL).
NOT_CARRYING: Final = frozenset("NBDTIGVE")
NOT_CARRYING_TYPES: Final = frozenset({"uuid", "pg_lsn", "txid_snapshot", "pg_snapshot", "regclass", "oid"})


@dataclass
class Relation:
    """A table, partition, materialized view or foreign table of the database, and its columns."""

    oid: int
    schema: str
    table: str
    relkind: str
    populated: bool
    usage: bool
    select: bool
    row_security: bool
    est_rows: float
    temp_of: str | None = None  # another session's temporary schema: whose
    columns: list[tuple[str, int, bool]] = field(default_factory=list)  # name, type oid, column SELECT


_CATALOG = """
SELECT c.oid, n.nspname::text, c.relname::text, c.relkind::text, c.relispopulated,
       has_schema_privilege(n.oid, 'USAGE'), has_table_privilege(c.oid, 'SELECT'),
       c.relkind = 'r' AND row_security_active(c.oid),
       GREATEST(c.reltuples, COALESCE(s.n_live_tup, 0))::float8,  -- never pg_relation_size: it takes a lock
       a.attname::text, a.atttypid, has_column_privilege(c.oid, a.attnum, 'SELECT'),
       n.nspname ~ '^pg_temp_' AND n.oid <> pg_my_temp_schema()
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_stat_all_tables s ON s.relid = c.oid
 WHERE c.relkind IN ('r', 'm', 'f') AND n.nspname <> ALL(%s) AND n.nspname !~ '^pg_toast_temp_'
   AND n.oid <> pg_my_temp_schema()
 ORDER BY 2, 3, a.attnum
"""


def type_kinds(conn: psycopg.Connection[Any]) -> dict[int, tuple[Kind, bool]]:
    """Type oid -> (kind, is an array) for every type whose values can carry a ciphertext, domains
    resolved to their base. Containers (arrays, composites, ranges, xml, hstore, ...) are read through
    their text form: key ids by pattern, binary ciphertexts as the base64 / hex tokens in it."""
    rows = conn.execute("SELECT t.oid, t.typname::text, t.typtype::text, t.typcategory::text, t.typbasetype, "
                        "t.typelem, t.typnamespace = 'pg_catalog'::regnamespace FROM pg_type t "
                        "WHERE t.typtype IN ('b', 'd', 'c', 'r', 'm')").fetchall()
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
            return ("container", True) if inner else None
        if builtin and name == "bytea":
            return "bytea", False
        if builtin and name in ("json", "jsonb"):
            return "json", False
        if category == "S":
            return "text", False
        if typtype in ("c", "r", "m"):
            return "container", False
        if category in NOT_CARRYING or (builtin and name in NOT_CARRYING_TYPES) or category == "P":
            return None
        return "container", False

    out: dict[int, tuple[Kind, bool]] = {}
    for oid in types:
        found = kind(oid)
        if found is not None:
            out[oid] = found
    return out


def configured_columns(conn: psycopg.Connection[Any], targets: Iterable[ConfiguredTarget]
                       ) -> dict[tuple[int, str], tuple[str, ...]]:
    """(table oid, column) of every configured cipher column -> its json_paths (empty: the whole column)."""
    out: dict[tuple[int, str], tuple[str, ...]] = {}
    for relation, columns, json_paths in targets:
        row = conn.execute("SELECT to_regclass(%s)::oid", (relation,)).fetchone()
        if row is None or row[0] is None:
            continue  # a missing table is BLOCKED in the inventory: the gate is closed anyway
        for column in columns:
            out[(int(row[0]), column)] = tuple(json_paths.get(column, ()))
    return out


def ancestors(conn: psycopg.Connection[Any]) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Every relation's parents (partitions and inheritance children are read through their parents), and
    the parents' names (``discover_skip`` of a partitioned table covers its partitions)."""
    parents: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    # A partition being detached (DETACH ... CONCURRENTLY left pending) is not read through its parent
    # any more: it is swept on its own.
    pending = "i.inhdetachpending" if conn.info.server_version >= 140000 else "false"
    for child, parent, name in conn.execute(
            "SELECT i.inhrelid, i.inhparent, n.nspname::text || '.' || c.relname::text FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhparent JOIN pg_namespace n ON n.oid = c.relnamespace "
            f"WHERE NOT {pending}").fetchall():
        parents.setdefault(int(child), []).append(int(parent))
        names[int(parent)] = str(name)
    return parents, names


def lineage_of(oid: int, parents: dict[int, list[int]]) -> Iterator[int]:
    seen: set[int] = set()
    todo = [oid]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            yield current
            todo.extend(parents.get(current, []))


def relations(conn: psycopg.Connection[Any]) -> dict[int, Relation]:
    """Every relation of the database outside ``SKIPPED_SCHEMAS`` (by oid), its columns and what the role
    may read of it; another session's temporary table names that session (``temp_sessions``)."""
    rels: dict[int, Relation] = {}
    sessions = temp_sessions(conn)
    unnamed = ("its session cannot be named before PostgreSQL 16" if conn.info.server_version < 160000
               else "no live session: left by a crash")
    for (oid, schema, table, relkind, populated, usage, select, rls, est, column, typid,
         column_select, other_temp) in conn.execute(_CATALOG, (list(SKIPPED_SCHEMAS),)).fetchall():
        rel = rels.get(int(oid))
        if rel is None:
            rel = rels[int(oid)] = Relation(int(oid), schema, table, relkind, bool(populated), bool(usage),
                                            bool(select), bool(rls), float(est),
                                            sessions.get(schema, unnamed) if other_temp else None)
        rel.columns.append((column, int(typid), bool(column_select)))
    return rels


def temp_sessions(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """Temporary schema name -> the session that owns it (pid and application_name; never what it runs).

    PostgreSQL 16+ numbers a temporary schema by its backend id, which ``pg_stat_get_backend_idset`` gives;
    before 16 that id is not visible, and the schema is named alone."""
    if conn.info.server_version < 160000:
        return {}
    rows = conn.execute("SELECT 'pg_temp_' || b.id, pg_stat_get_backend_pid(b.id), coalesce(a.application_name, '') "
                        "FROM pg_stat_get_backend_idset() AS b(id) "
                        "LEFT JOIN pg_stat_activity a ON a.pid = pg_stat_get_backend_pid(b.id)").fetchall()
    return {str(name): f"pid {pid}, application_name {str(app)!r}" for name, pid, app in rows}
