"""The compare-and-swap write guard's statements on PostgreSQL (fpc1; MySQL's are
``mysql/guard.py``): one statement that locks a write's rows ``SKIP LOCKED`` and writes each
column only where it still holds the value read, returning what it locked and what it wrote
(``update``), and the read of the rows a write missed (``missed_rows``). Settling the misses,
outcomes and CONFLICT records are the caller's (``drain/guard_cas.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from psycopg import sql

from .stored import stored_as_sent


def update(relation: sql.Composable, id_column: sql.Composable, id_type: str,
           columns: Sequence[tuple[str, str]], scope: sql.Composable, lock: sql.Composable) -> sql.Composed:
    """One set-based statement for a write of ``columns`` ((name, ``pg_type.typname``) pairs) of
    ``relation``, found by ``id_column`` (``id_type``: its ``pg_type.typname``); ``scope``: the
    rows it may touch (aliased ``t``); ``lock``: the row lock (``FOR UPDATE`` / ``FOR NO KEY
    UPDATE``). It returns (true, id, stored as sent) per row written, (false, id, true) per row
    locked; a row an application holds locked is neither. Its parameters: the ids, then the
    value read and the new value of each column, as text arrays."""
    arrays: list[sql.Composable] = [sql.SQL("%s::{}[]").format(sql.Identifier(id_type))]
    arrays += [sql.SQL("%s::text[]")] * (2 * len(columns))
    names: list[sql.Composable] = []
    sets: list[sql.Composable] = []
    same: list[sql.Composable] = []
    stored: list[sql.Composable] = []
    for i, (name, type_name) in enumerate(columns):
        old, new = sql.Identifier(f"o{i}"), sql.Identifier(f"n{i}")
        names += [old, new]
        ref = sql.Identifier("t", name)
        if type_name == "jsonb":
            sets.append(sql.SQL("{} = u.{}::jsonb").format(sql.Identifier(name), new))
            same.append(sql.SQL("{} = u.{}::jsonb").format(ref, old))
            stored.append(stored_as_sent(name, type_name, sql.SQL("u.{}::jsonb").format(new)))
        elif type_name == "json":
            sets.append(sql.SQL("{} = u.{}::json").format(sql.Identifier(name), new))
            same.append(sql.SQL("{}::text = u.{}").format(ref, old))
            stored.append(stored_as_sent(name, type_name, sql.SQL("u.{}").format(new)))
        else:
            sets.append(sql.SQL("{} = u.{}").format(sql.Identifier(name), new))
            same.append(sql.SQL("{} = u.{}").format(ref, old))
            stored.append(stored_as_sent(name, type_name, sql.SQL("u.{}").format(new)))
    # Lock first, never wait: a row an application holds locked is skipped (left for the
    # sweep or the next run, as the lock guard's SKIP LOCKED leaves it), the others are
    # locked and written where they still hold the values read.
    return sql.SQL(
        "WITH pinrotate_locked AS MATERIALIZED ("
        "SELECT u.* FROM unnest({arrays}) AS u(pinrotate_id, {names}) JOIN {rel} AS t "
        "ON t.{id} = u.pinrotate_id {lock} OF t SKIP LOCKED), "
        "pinrotate_moved AS (UPDATE {rel} AS t SET {sets} FROM pinrotate_locked AS u "
        "WHERE t.{id} = u.pinrotate_id AND {same} AND {scope} "
        "RETURNING t.{id} AS pinrotate_id, {stored} AS pinrotate_stored) "
        "SELECT true, pinrotate_id, pinrotate_stored FROM pinrotate_moved "
        "UNION ALL SELECT false, pinrotate_id, true FROM pinrotate_locked"
    ).format(rel=relation, sets=sql.SQL(", ").join(sets), arrays=sql.SQL(", ").join(arrays),
             names=sql.SQL(", ").join(names), id=id_column, same=sql.SQL(" AND ").join(same),
             scope=scope, stored=sql.SQL(" AND ").join(stored), lock=lock)


def missed_rows(relation: sql.Composable, id_column: sql.Composable, columns: Sequence[str],
                scope: sql.Composable) -> sql.Composed:
    """The rows of ``relation`` still in ``scope`` (unaliased) among the ids given (one parameter:
    a list): their id and the text of each of ``columns``, as they are now."""
    return sql.SQL("SELECT {id}, {cols} FROM {rel} WHERE {id} = ANY(%s) AND {scope}").format(
        id=id_column, cols=sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c)) for c in columns),
        rel=relation, scope=scope)
