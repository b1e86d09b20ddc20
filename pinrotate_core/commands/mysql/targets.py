"""Target resolution on MySQL / MariaDB: the rules of ``targets.resolve_target`` over the room's
``TableCatalog`` (``engines/mysql/catalog.py`` holds the SQL; here only what is BLOCKED and why).

Types are named as the schemes know them (``bytea`` for MySQL's binary types, ``text``,
``varchar``, ``bpchar`` for ``char``, ``int8`` ...), so that a scheme picks the same encoding as on
PostgreSQL (raw bytes in a binary column, base64 in a text one).

MySQL's own rules on top of PostgreSQL's:

- ``triggers = "disable"`` is BLOCKED: MySQL has no ``session_replication_role``, nothing can
  silence a trigger for one session;
- a generated column among those read or written is BLOCKED (a STORED one computed from a cipher
  column would change with it);
- the role needs SELECT and UPDATE on every ``ON UPDATE CURRENT_TIMESTAMP`` column when it writes:
  a run keeps such a column by setting it to itself (``MySqlCasGuard.needed_privileges``).
"""

from __future__ import annotations

from psycopg import sql

from ...config import TargetSettings
from ...engines.base.catalog import CatalogColumn, TableCatalog
from ...engines.mysql.catalog import CATALOG
from ...engines.mysql.connect import MySqlConnection
from ...errors import TargetBlocked
from ...targets import Column, ResolvedTarget, TypeWords, check_shape, lacking_privileges, read_columns

# MySQL's DATA_TYPE -> the type name the schemes and the rules above know.
TYPE_NAMES = {
    "tinyint": "int2", "smallint": "int2", "mediumint": "int4", "int": "int4", "integer": "int4", "bigint": "int8",
    "decimal": "numeric", "numeric": "numeric",
    "char": "bpchar", "varchar": "varchar",
    "tinytext": "text", "text": "text", "mediumtext": "text", "longtext": "text",
    "binary": "bytea", "varbinary": "bytea", "tinyblob": "bytea", "blob": "bytea", "mediumblob": "bytea",
    "longblob": "bytea", "json": "json",
}

MYSQL_TYPES = TypeWords("integer, decimal and char or varchar", "a binary, text or varchar type")


def _column(c: CatalogColumn) -> Column:
    return Column(c.name, c.sql_type, TYPE_NAMES.get(c.type_name, c.type_name), c.char_length)


def read_table(conn: MySqlConnection, t: TargetSettings, *, writing: bool) -> TableCatalog:
    written = [*t.columns, *([t.key_version] if t.key_version else [])]
    found = CATALOG.read_table(conn, t.schema_name, t.table_name, select=read_columns(t) if not writing else (),
                               update=())
    if found is None:
        raise TargetBlocked(t.name, f"table {t.table} does not exist")
    if not writing:
        return found
    # A run keeps ON UPDATE CURRENT_TIMESTAMP columns by setting them to themselves: it needs them too.
    kept = [c.name for c in found.auto_updated if c.name not in written]
    return CATALOG.read_table(conn, t.schema_name, t.table_name, select=[*read_columns(t), *kept],
                              update=[*written, *kept]) or found


def resolve_mysql_target(conn: MySqlConnection, t: TargetSettings, *, writing: bool = True) -> ResolvedTarget:
    """``t`` checked against the MySQL catalog; TargetBlocked naming what is wrong."""
    found = read_table(conn, t, writing=writing)
    if found.notes:
        raise TargetBlocked(t.name, f"{t.table} is {found.notes[0]}")
    if writing and found.read_only:
        raise TargetBlocked(t.name, f"the database connection is read-only ({', '.join(found.read_only)})")
    if found.missing_privileges:  # before the shape: a column the role holds nothing on is hidden, not absent
        raise TargetBlocked(t.name, lacking_privileges(found.role, t.table, found.missing_privileges))
    cols = {name: _column(c) for name, c in found.columns.items()}
    id_column, key_version, cipher_cols = check_shape(t, cols, list(found.primary_key), MYSQL_TYPES)
    generated = [n for n in read_columns(t) if found.columns[n].generated]
    if generated:
        raise TargetBlocked(t.name, f"column {generated[0]} of {t.table} is a generated column: "
                                    "pinrotate neither writes it nor lets the server recompute it from a cipher column")
    _check_triggers(t, found)
    return ResolvedTarget(t, sql.Identifier(found.schema, found.table), id_column, key_version, cipher_cols)


def _check_triggers(t: TargetSettings, found: TableCatalog) -> None:
    """UPDATE triggers: BLOCKED unless ``triggers = "fire"``; ``"disable"`` is BLOCKED on MySQL
    (nothing silences a trigger for one session there)."""
    if not found.update_triggers or t.triggers == "fire":
        return
    names = ", ".join(tr.name for tr in found.update_triggers)
    if t.triggers == "disable":
        raise TargetBlocked(t.name, f"{t.table} has UPDATE triggers: {names}; triggers = \"disable\" cannot be "
                                    "honoured on MySQL / MariaDB (no session_replication_role: nothing silences a "
                                    "trigger for one session); drop them for the run or set triggers = \"fire\"")
    raise TargetBlocked(t.name, f"{t.table} has UPDATE triggers that re-encryption would fire: {names}; "
                                "set triggers = \"fire\" on the target (\"disable\" is not possible on MySQL / MariaDB)")
