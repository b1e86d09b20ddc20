"""The catalog of a MySQL / MariaDB table (``base.catalog``): columns from
``information_schema.COLUMNS`` (generated ones, and those ``ON UPDATE CURRENT_TIMESTAMP`` rewrites
on every UPDATE), the primary key, UPDATE triggers, the role's privileges and whether the
connection can write. Reads only; raises DatabaseError (fail closed) when it cannot read.

Privileges are asked of the server itself (``EXPLAIN`` of the statements a run would send), not
recomputed from the grant tables: roles, wildcard hosts and table-, database- or global-level
grants are then all taken into account as the server does.
"""

from __future__ import annotations

from collections.abc import Sequence

import pymysql

from ...errors import DatabaseError
from ..base.catalog import CatalogColumn, TableCatalog, UpdateTrigger
from .connect import LOCK_WAIT_TIMEOUT, MySqlConnection, TableLockedByDdl, describe_db_error, error_number
from .operations import OPERATIONS as ops

# ER_TABLEACCESS_DENIED_ERROR, ER_COLUMNACCESS_DENIED_ERROR: a privilege the role lacks.
_DENIED = frozenset({1142, 1143})
_NO_SUCH_COLUMN = 1054  # ER_BAD_FIELD_ERROR: a configured column the table does not have (check_shape names it)
# Every variable that can make this connection unable to write, on MySQL 8 or MariaDB (each knows
# some of them: MariaDB < 11.1 has tx_read_only, MySQL 8 transaction_read_only and super_read_only).
READ_ONLY_VARIABLES = ("read_only", "super_read_only", "innodb_read_only", "transaction_read_only", "tx_read_only")


def read_only_reasons(conn: MySqlConnection) -> tuple[str, ...]:
    """``@@name = ON`` for each read-only switch that is on; empty: this connection may write.

    ``read_only`` lets a SUPER / READ_ONLY ADMIN user write still, but a server set read-only is
    a replica or one being failed over: pinrotate does not write there either.
    """
    names = ", ".join(f"'{n}'" for n in READ_ONLY_VARIABLES)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SHOW VARIABLES WHERE Variable_name IN ({names})")
            rows = cur.fetchall()
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"cannot read the read-only settings ({describe_db_error(e)})") from None
    return tuple(f"@@{name} = ON" for name, value in sorted(rows) if str(value).upper() in ("ON", "1"))


def current_role(conn: MySqlConnection) -> str:
    with conn.cursor() as cur:
        cur.execute("SELECT CURRENT_USER()")
        row = cur.fetchone()
    return str(row[0]) if row else "?"


class MySqlCatalog:
    def read_table(self, conn: MySqlConnection, schema: str | None, table: str, *, select: Sequence[str] = (),
                   update: Sequence[str] = ()) -> TableCatalog | None:
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT COALESCE(%s, DATABASE()), CURRENT_USER()", (schema,))
                row = cur.fetchone()
                assert row is not None
                if row[0] is None:
                    raise DatabaseError("the database URL names no database and the table no schema")
                schema_name, role = str(row[0]), str(row[1])
                cur.execute("SELECT TABLE_TYPE FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s"
                            " AND TABLE_NAME = %s", (schema_name, table))
                kind = cur.fetchone()
                if kind is None:
                    return None
                cur.execute(
                    "SELECT COLUMN_NAME, COLUMN_TYPE, DATA_TYPE, CHARACTER_MAXIMUM_LENGTH, EXTRA"
                    " FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s"
                    " ORDER BY ORDINAL_POSITION", (schema_name, table))
                columns = {str(name): _column(str(name), str(ctype), str(dtype), length, str(extra or ""))
                           for name, ctype, dtype, length, extra in cur.fetchall()}
                cur.execute(
                    "SELECT COLUMN_NAME FROM information_schema.KEY_COLUMN_USAGE WHERE TABLE_SCHEMA = %s"
                    " AND TABLE_NAME = %s AND CONSTRAINT_NAME = 'PRIMARY' ORDER BY ORDINAL_POSITION",
                    (schema_name, table))
                primary_key = tuple(str(r[0]) for r in cur.fetchall())
                cur.execute(
                    "SELECT TRIGGER_NAME, ACTION_TIMING FROM information_schema.TRIGGERS"
                    " WHERE EVENT_OBJECT_SCHEMA = %s AND EVENT_OBJECT_TABLE = %s AND EVENT_MANIPULATION = 'UPDATE'"
                    " ORDER BY ACTION_TIMING, ACTION_ORDER", (schema_name, table))
                triggers = tuple(UpdateTrigger(str(n), f"{schema_name}.{table}", str(timing))
                                 for n, timing in cur.fetchall())
        except pymysql.err.MySQLError as e:
            raise DatabaseError(f"table {schema or ''}{'.' if schema else ''}{table}: cannot read the catalog "
                                f"({describe_db_error(e)})") from None
        notes = ("a view, not a base table",) if str(kind[0]) != "BASE TABLE" else ()
        missing = missing_privileges(conn, schema_name, table, select=select, update=update)
        return TableCatalog(schema_name, table, columns, primary_key, triggers, role, missing,
                            read_only_reasons(conn), notes)


def _column(name: str, column_type: str, data_type: str, length: object, extra: str) -> CatalogColumn:
    extra = extra.lower()
    char_length = int(length) if data_type.lower() in ("varchar", "char") and isinstance(length, int) else None
    return CatalogColumn(name, column_type, data_type.lower(), char_length,
                         generated="generated" in extra, auto_updated="on update" in extra)


def missing_privileges(conn: MySqlConnection, schema: str, table: str, *, select: Sequence[str] = (),
                       update: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """(privilege, column) for each column the role may not SELECT (``select``) or UPDATE
    (``update``) on ``schema.table``, as the server decides: an ``EXPLAIN`` of the statement a run
    sends, which is checked for privileges and never executed. One probe for all; one per column
    only when it is refused (or names a column the table does not have), to name them. An absent
    column lacks no privilege: the target's shape check reports it (BLOCKED), not this one."""
    relation = ops.relation(schema, table)

    def refused(statement: str) -> bool | None:
        """True: refused; None: a column of it does not exist; False: allowed."""
        try:
            with conn.cursor() as cur:
                cur.execute(f"EXPLAIN {statement}", ())  # () : the quoted names' %% become %
                cur.fetchall()
        except pymysql.err.MySQLError as e:
            if error_number(e) in _DENIED:
                return True
            if error_number(e) == _NO_SUCH_COLUMN:
                return None
            message = f"table {schema}.{table}: cannot check the privileges ({describe_db_error(e)})"
            if error_number(e) == LOCK_WAIT_TIMEOUT:  # the EXPLAIN waits for the table's metadata lock too
                raise TableLockedByDdl(message, f"{schema}.{table}", describe_db_error(e)) from None
            raise DatabaseError(message) from None
        return False

    def reading(cols: Sequence[str]) -> str:
        return f"SELECT {', '.join(map(ops.quote, cols))} FROM {relation} LIMIT 0"

    def writing(cols: Sequence[str]) -> str:
        return f"UPDATE {relation} SET {', '.join(f'{ops.quote(c)} = NULL' for c in cols)} WHERE FALSE"

    missing: list[tuple[str, str]] = []
    for privilege, columns, statement in (("SELECT", list(select), reading), ("UPDATE", list(update), writing)):
        if columns and refused(statement(columns)) is not False:
            missing += [(privilege, c) for c in columns if refused(statement([c])) is True]
    return tuple(missing)


CATALOG = MySqlCatalog()
