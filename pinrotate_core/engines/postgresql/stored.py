"""What a write guard's UPDATE compares in its RETURNING: the value a column holds after the
UPDATE (BEFORE UPDATE triggers' effects included) against the value sent, in the server. Both
PostgreSQL write guards ask it (``row_versions``, ``guard_cas``)."""

from __future__ import annotations

from psycopg import sql

# Text types compared byte for byte (a deterministic collation's equality), whatever the column's collation.
_COLLATABLE = frozenset({"text", "varchar", "bpchar"})


def stored_as_sent(name: str, type_name: str, sent: sql.Composable, alias: str = "t") -> sql.Composable:
    """SQL, true when the value column ``name`` (of base type ``type_name``, ``pg_type.typname``)
    holds after an UPDATE (in its RETURNING: BEFORE UPDATE triggers' effects included) is the value
    ``sent``, of the column's own base type."""
    ref = sql.Identifier(alias, name)
    if type_name == "json":  # no equality operator: its text, as stored
        return sql.SQL("{}::text IS NOT DISTINCT FROM {}::text").format(ref, sent)
    if type_name in _COLLATABLE:
        return sql.SQL('{} IS NOT DISTINCT FROM {} COLLATE "C"').format(ref, sent)
    return sql.SQL("{} IS NOT DISTINCT FROM {}").format(ref, sent)
