"""Row versions on PostgreSQL (``features.has_row_versions``): a row's ``ctid`` and ``xmin``, and on
a partitioned or inherited table its ``tableoid`` and that table's file, read in binary as
PostgreSQL sends them and sent back as one array each (``version_cursor``), and the statements of
the row-version write guard (``VersionStatements``: the cautious write's lock, the UPDATE joined on
the version read). What to decide over them (outcomes, retries, what is swept) is the caller's
(``drain/guard_version.py``)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import postgres, sql
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.types.string import ByteaBinaryLoader

from .stored import stored_as_sent


class Tids(list[bytes]):
    """Row ``ctid`` values as PostgreSQL sends them in binary (6 bytes each), to be sent back."""


class Xids(list[bytes]):
    """Row ``xmin`` values as PostgreSQL sends them in binary (4 bytes each), to be sent back."""


class Oids(list[bytes]):
    """``oid`` values (a row's ``tableoid``, its table's file) as PostgreSQL sends them in binary (4 bytes each)."""


class Oid(bytes):
    """One ``oid`` as PostgreSQL sends it in binary (4 bytes), to be sent back."""


class Tid(bytes):
    """One ``tid`` as PostgreSQL sends it in binary (6 bytes), to be sent back."""


class _AsSentDumper(Dumper):
    """A value sent back in binary exactly as PostgreSQL sent it."""

    format = Format.BINARY

    def dump(self, obj: Any) -> bytes:
        return bytes(obj)


class _OidDumper(_AsSentDumper):
    oid = postgres.types["oid"].oid


class _TidDumper(_AsSentDumper):
    oid = postgres.types["tid"].oid


class _PackedArrayDumper(Dumper):
    """A one-dimensional binary array of fixed-size binary values, built in one join (no Python
    call per element: these travel once per row)."""

    format = Format.BINARY
    element_oid = 0
    element_size = 0

    def dump(self, obj: Any) -> bytes:
        if not obj:
            return _HEAD.pack(0, 0, self.element_oid)
        size = _INT.pack(self.element_size)
        if sum(map(len, obj)) != len(obj) * self.element_size:  # never from PostgreSQL; never sent malformed
            raise ValueError(f"a row version of the wrong size for oid {self.element_oid}")
        return _HEAD.pack(1, 0, self.element_oid) + _DIM.pack(len(obj), 1) + size + size.join(obj)


class _TidsDumper(_PackedArrayDumper):
    oid = postgres.types["tid"].array_oid
    element_oid = postgres.types["tid"].oid
    element_size = 6


class _OidsDumper(_PackedArrayDumper):
    oid = postgres.types["oid"].array_oid
    element_oid = postgres.types["oid"].oid
    element_size = 4


class _XidsDumper(_PackedArrayDumper):
    oid = postgres.types["xid"].array_oid
    element_oid = postgres.types["xid"].oid
    element_size = 4


_HEAD = struct.Struct("!iiI")  # dimensions, has-nulls flag, element type
_DIM = struct.Struct("!ii")  # length, lower bound
_INT = struct.Struct("!i")


def version_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """A binary cursor that reads ``tid``, ``xid`` and ``oid`` as the bytes PostgreSQL sends and
    sends ``Tids``, ``Xids`` and ``Oids`` back as arrays of them (this cursor only: the connection's other users
    read them as usual)."""
    cur = conn.cursor(binary=True)
    cur.adapters.register_loader("tid", ByteaBinaryLoader)
    cur.adapters.register_loader("xid", ByteaBinaryLoader)
    cur.adapters.register_loader("oid", ByteaBinaryLoader)
    cur.adapters.register_dumper(Tids, _TidsDumper)
    cur.adapters.register_dumper(Xids, _XidsDumper)
    cur.adapters.register_dumper(Oids, _OidsDumper)
    cur.adapters.register_dumper(Oid, _OidDumper)
    cur.adapters.register_dumper(Tid, _TidDumper)
    return cur


def typed(held: list[list[bytes]], tree: bool) -> list[list[bytes]]:
    """The row versions kept (as read: a plain table's ctid and xmin; a tree's tableoid, ctid, xmin
    and file), typed for the statements' arrays."""
    if tree:
        tableoid, ctid, xmin, file = held
        return [Oids(tableoid), Tids(ctid), Xids(xmin), Oids(file)]
    ctid, xmin = held
    return [Tids(ctid), Xids(xmin)]


class VersionStatements:
    """The statements of the row-version write on one table: ``relation``, its id column ``id_column``
    (``id_type``: its ``pg_type.typname``); ``versions``: the system columns a row version is read
    as (empty: a dry run, which reads none); ``tree``: several heaps (a partitioned or inherited
    table), a row version names its table too; ``inherited``: ids may repeat across the tree;
    ``lock``: the row lock the cautious write takes (``FOR UPDATE`` / ``FOR NO KEY UPDATE``)."""

    def __init__(self, relation: sql.Composable, id_column: sql.Composable, id_type: str, versions: Sequence[str], *,
                 tree: bool, inherited: bool, lock: sql.Composable) -> None:
        self.relation = relation
        self.tree = tree
        # A row of a tree of tables is read with its table (tableoid) and that table's file: a
        # table rewritten since the read (VACUUM FULL, CLUSTER) keeps each row's xmin but not its
        # ctid, and an inheritance child's ids need not be unique, so only the file tells a rewrite apart.
        names = list(versions)
        self.extra: list[sql.Composable] = [sql.Identifier(v) for v in names]
        if self.tree and names:
            self.extra.append(sql.SQL("pg_relation_filenode(tableoid)"))
        # Rows of one id (an inheritance tree's ids repeat; a partitioned table's primary key
        # covers every partition), in the order of their table and place in it.
        self.then_by: list[sql.Composable] = (
            [sql.Identifier("tableoid"), sql.Identifier("ctid")] if inherited and names else [])
        id_type_name = sql.Identifier(id_type)
        # What the write sends per row: its id, then its row version, as arrays of the same length.
        self._arrays: list[sql.Composable] = [sql.SQL("%b::{}[]").format(id_type_name)]
        self._keys: list[sql.Composable] = [sql.Identifier("pinrotate_id")]
        # Found by its ctid (one heap fetch per table). The id is still checked: on a plain table a
        # rewrite since the read may have put another row inserted by the same transaction at that
        # ctid, with the same xmin. It is checked with IS NOT DISTINCT FROM (the same as = for a
        # key), which the planner never turns into a second probe of the primary key.
        match: list[sql.Composable] = []
        if self.tree:
            self._arrays.append(sql.SQL("%b::oid[]"))
            self._keys.append(sql.Identifier("pinrotate_tableoid"))
            match.append(sql.SQL("t.tableoid = u.pinrotate_tableoid"))
        self._arrays.append(sql.SQL("%b::tid[]"))
        self._keys.append(sql.Identifier("pinrotate_ctid"))
        match += [sql.SQL("t.ctid = u.pinrotate_ctid"),
                  sql.SQL("t.{} IS NOT DISTINCT FROM u.pinrotate_id").format(id_column)]
        self._where_row = sql.SQL(" AND ").join(match)  # the row, whatever its version now
        self._arrays.append(sql.SQL("%b::xid[]"))
        self._keys.append(sql.Identifier("pinrotate_xmin"))
        match.append(sql.SQL("t.xmin = u.pinrotate_xmin"))
        if self.tree:
            self._arrays.append(sql.SQL("%b::oid[]"))
            self._keys.append(sql.Identifier("pinrotate_file"))
            match.append(sql.SQL("pg_relation_filenode(t.tableoid) = u.pinrotate_file"))
        self._where_version = sql.SQL(" AND ").join(match)  # the row, still the version read
        # The cautious write's lock: what is free among the rows, by position (1-based); a row an
        # application holds locked is skipped, never waited on. Its parameters: the ids, then the
        # row versions (``typed``) up to the ctid (``lock_params``).
        self.lock = sql.SQL(
            "SELECT u.pinrotate_n FROM unnest({arrays}) WITH ORDINALITY AS u({keys}, pinrotate_n) "
            "JOIN {rel} AS t ON {match} {lock} OF t SKIP LOCKED"
        ).format(lock=lock, arrays=sql.SQL(", ").join(self._arrays[:-2 if self.tree else -1]),
                 keys=sql.SQL(", ").join(self._keys[:-2 if self.tree else -1]), rel=relation,
                 match=self._where_row)

    def lock_params(self, ids: list[Any], held: list[list[bytes]]) -> list[Any]:
        """The parameters of ``lock``: the ids and the row versions ``held`` that find the rows."""
        return [ids, *typed(held, self.tree)[:len(held) - (2 if self.tree else 1)]]

    def update(self, columns: Sequence[tuple[str, str]], key_version: tuple[str, int] | None,
               guard: sql.Composable) -> sql.Composed:
        """One set-based statement for a write of ``columns`` ((name, ``pg_type.typname``) pairs),
        joined on the row version read; arrays are cast to base types (``varchar``, never
        ``varchar(n)``), so a value too long for its column is an error that rolls the batch back,
        never a silent truncation. ``key_version``: (column, the current version) it sets too;
        ``guard``: what the row must still be (stale, in scope; aliased ``t``). It returns what the
        database stored, compared in the server with what was sent (trigger effects included): (rows
        written, positions of rows that differ, positions written if not every row was). Its
        parameters: the ids, the row versions (``typed``), a new value array per column, the row count."""
        arrays = [*self._arrays, *(sql.SQL("%b::{}[]").format(sql.Identifier(type_name)) for _, type_name in columns)]
        names = [sql.Identifier(f"n{i}") for i in range(len(columns))]
        sets = [sql.SQL("{} = u.{}").format(sql.Identifier(c), n) for (c, _), n in zip(columns, names)]
        stored = [stored_as_sent(c, type_name, sql.SQL("u.{}").format(n)) for (c, type_name), n in zip(columns, names)]
        if key_version is not None:
            kv, current = key_version
            version = sql.Literal(current)
            sets.append(sql.SQL("{} = {}").format(sql.Identifier(kv), version))
            stored.append(sql.SQL("t.{} IS NOT DISTINCT FROM {}").format(sql.Identifier(kv), version))
        # The row version read, still stale and in scope: anything else is someone else's newer row.
        return sql.SQL(
            "WITH pinrotate_written AS (UPDATE {rel} AS t SET {sets} "
            "FROM unnest({arrays}) WITH ORDINALITY AS u({keys}, {names}, pinrotate_n) "
            "WHERE {match} AND {guard} RETURNING u.pinrotate_n, {stored} AS pinrotate_stored) "
            "SELECT count(*), array_agg(pinrotate_n) FILTER (WHERE NOT pinrotate_stored), "
            "CASE WHEN count(*) < %b::int8 THEN array_agg(pinrotate_n) END FROM pinrotate_written"
        ).format(rel=self.relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
                 keys=sql.SQL(", ").join(self._keys), names=sql.SQL(", ").join(names),
                 match=self._where_version, guard=guard, stored=sql.SQL(" AND ").join(stored))
