"""The catalog of a PostgreSQL table (``base.catalog``): columns (generated and identity ones), the
primary key, whether it is a plain table or a tree of tables, the role's column privileges,
row-level security, UPDATE triggers and ON UPDATE rules (with their firing mode), unique indexes
over written columns, whether the role may set ``session_replication_role``, and the BEGIN of a
writing batch. Reads only.

The pieces raise ``psycopg.Error`` as the server sends it: ``targets.py`` names the target in its
one-line DatabaseError and keeps the rules (what is BLOCKED). ``CATALOG.read_table`` is the same
reads answered as the engine-neutral ``TableCatalog``; it raises DatabaseError (fail closed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ...errors import DatabaseError
from ..base.catalog import CatalogColumn, TableCatalog, UpdateTrigger
from .connect import PgConnection

# pg_trigger.tgenabled / pg_rewrite.ev_enabled: 'O' fires in the normal (origin) mode only, 'R' in
# replica mode only, 'A' always ('D': disabled, never listed).
FIRES_NORMALLY = "OA"
FIRES_UNDER_REPLICA_ROLE = "RA"


@dataclass(frozen=True)
class PgTable:
    """What resolving a target reads of its table first (``table``)."""

    oid: int
    in_recovery: bool
    read_only: bool  # transaction_read_only is on
    columns: dict[str, CatalogColumn]
    unwritable: dict[str, str]  # column -> why no UPDATE may set it
    primary_key: tuple[str, ...]
    by_ctid: bool  # a plain table without inheritance children
    inherited: bool  # a plain table with inheritance children


@dataclass(frozen=True)
class RowSecurity:
    """Row-level security applies to ``role`` on the table (``row_security``)."""

    role: str
    owner: bool  # the role owns the table (it applies anyway: FORCE ROW LEVEL SECURITY)
    forced: bool


@dataclass(frozen=True)
class PgTrigger:
    """An enabled UPDATE trigger (or ``rule <name>``, an ON UPDATE rule) that an UPDATE of the
    table fires; ``relation``: the table it is on (a partition or child, or the table itself)."""

    name: str
    on_table: bool
    relation: str
    mode: str  # tgenabled / ev_enabled: O, R or A
    before: bool  # a BEFORE trigger (False: AFTER; a rule counts as AFTER)


def table(conn: PgConnection, regname: str) -> PgTable | None:
    """The table named ``regname`` (a quoted relation text), None when it does not exist."""
    row = conn.execute(
        "SELECT to_regclass(%s)::oid, pg_is_in_recovery(), current_setting('transaction_read_only')",
        (regname,),
    ).fetchone()
    assert row is not None
    oid, in_recovery, read_only = row
    if oid is None:
        return None
    cols: dict[str, CatalogColumn] = {}
    unwritable: dict[str, str] = {}
    for name, sql_type, type_name, char_len, generated, identity in conn.execute(
            """
            SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typname,
                   CASE WHEN t.typname IN ('varchar', 'bpchar') AND a.atttypmod > 4
                        THEN a.atttypmod - 4 END,
                   a.attgenerated::text, a.attidentity::text
              FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
             WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
            """,
            (oid,),
    ).fetchall():
        cols[str(name)] = CatalogColumn(str(name), str(sql_type), str(type_name),
                                        char_len if isinstance(char_len, int) else None, generated=bool(generated))
        if generated:
            unwritable[str(name)] = "a generated column (GENERATED ALWAYS AS ... STORED)"
        elif identity == "a":
            unwritable[str(name)] = "an identity column (GENERATED ALWAYS AS IDENTITY)"
    kind = conn.execute("SELECT relkind = 'r' AND NOT relhassubclass, relkind = 'r' AND relhassubclass"
                        " FROM pg_class WHERE oid = %s", (oid,)).fetchone()
    pk_row = conn.execute(
        """
        SELECT array_agg(a.attname::text ORDER BY a.attnum)
          FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
         WHERE i.indrelid = %s AND i.indisprimary
        """,
        (oid,),
    ).fetchone()
    pk = tuple(str(c) for c in pk_row[0]) if pk_row and isinstance(pk_row[0], list) else ()
    by_ctid, inherited = (bool(kind[0]), bool(kind[1])) if kind else (False, False)
    return PgTable(int(oid), bool(in_recovery), read_only == "on", cols, unwritable, pk, by_ctid, inherited)


def missing_privileges(conn: PgConnection, oid: object,
                       wanted: Sequence[tuple[str, str]]) -> tuple[tuple[tuple[str, str], ...], str]:
    """((privilege, column) the role lacks among ``wanted`` (column, privilege), in their order;
    the role's name).

    Column by column (``has_column_privilege`` is true for a table-wide grant too), so the least
    privilege PostgreSQL offers, ``GRANT SELECT (cols), UPDATE (cols) ON table``, is enough.
    """
    rows = conn.execute(
        "SELECT w.col, w.priv, has_column_privilege(%s::oid, w.col, w.priv), current_user::text "
        "FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS w(col, priv, n) ORDER BY w.n",
        (oid, [c for c, _ in wanted], [p for _, p in wanted])).fetchall()
    missing = tuple((str(privilege), str(column)) for column, privilege, granted, _ in rows if not granted)
    return missing, (str(rows[0][3]) if rows else current_role(conn))


def row_security(conn: PgConnection, oid: object) -> RowSecurity | None:
    """Whether row-level security applies to the connecting role on the table (None: it does not).

    ``row_security_active`` is PostgreSQL's own answer (superusers and BYPASSRLS roles bypass; the
    owner bypasses unless FORCE ROW LEVEL SECURITY).
    """
    row = conn.execute(
        """
        SELECT row_security_active(c.oid), current_user, r.rolbypassrls,
               pg_has_role(current_user, c.relowner, 'USAGE'), c.relforcerowsecurity
          FROM pg_class c, pg_roles r
         WHERE c.oid = %s AND r.rolname = current_user
        """,
        (oid,),
    ).fetchone()
    if row is None or not row[0]:
        return None
    _, role, _, owner, forced = row
    return RowSecurity(str(role), bool(owner), bool(forced))


def update_triggers(conn: PgConnection, oid: object, written: Sequence[str]) -> list[PgTrigger]:
    """The non-internal, enabled UPDATE triggers of the table and of its partitions and inheritance
    children (an UPDATE through the parent fires theirs too), row- and statement-level, leaving out
    ``UPDATE OF`` triggers on columns not in ``written``; and ON UPDATE rules of the table, which
    rewrite the UPDATE the same way. Ordered by relation, then name."""
    rows = conn.execute(
        """
        WITH RECURSIVE rels(oid) AS (
            SELECT %s::oid
            UNION
            SELECT i.inhrelid FROM pg_inherits i JOIN rels ON i.inhparent = rels.oid
        )
        SELECT tg.tgname::text, tg.tgrelid = %s::oid, tg.tgrelid::regclass::text, tg.tgenabled::text,
               (tg.tgtype::int & 2) <> 0       -- TRIGGER_TYPE_BEFORE
          FROM pg_trigger tg JOIN rels ON tg.tgrelid = rels.oid
         WHERE NOT tg.tgisinternal
           AND (tg.tgtype::int & 16) <> 0          -- TRIGGER_TYPE_UPDATE
           AND tg.tgenabled <> 'D'
           AND (cardinality(tg.tgattr::int2[]) = 0
                OR tg.tgattr::int2[] && ARRAY(SELECT a.attnum FROM pg_attribute a
                                               WHERE a.attrelid = tg.tgrelid AND a.attname = ANY(%s)))
        UNION ALL
        SELECT 'rule ' || r.rulename::text, true, r.ev_class::regclass::text, r.ev_enabled::text, false
          FROM pg_rewrite r
         WHERE r.ev_class = %s::oid AND r.ev_type = '2' AND r.ev_enabled <> 'D'   -- ON UPDATE rules
         ORDER BY 3, 1
        """,
        (oid, oid, list(written), oid),
    ).fetchall()
    return [PgTrigger(str(name), bool(on_table), str(rel), str(mode), bool(before))
            for name, on_table, rel, mode, before in rows]


def current_role(conn: PgConnection) -> str:
    row = conn.execute("SELECT current_user").fetchone()
    return str(row[0]) if row else "?"


def may_silence_triggers(conn: PgConnection) -> bool:
    """May this role ``SET LOCAL session_replication_role = replica`` (superuser, or on PostgreSQL
    15+ ``GRANT SET ON PARAMETER session_replication_role``)? Tried in a transaction rolled back."""
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("SET LOCAL session_replication_role = replica")
    except psycopg.errors.InsufficientPrivilege:
        return False
    return True


def in_unique_index(conn: PgConnection, oid: object, written: Sequence[str]) -> bool:
    """Is a column of ``written`` in a unique index of the table or of one of its partitions or
    inheritance children (PostgreSQL then takes a key update's FOR UPDATE lock for the row)?"""
    row = conn.execute(
        """
        WITH RECURSIVE rels(oid) AS (
            SELECT %s::oid
            UNION
            SELECT i.inhrelid FROM pg_inherits i JOIN rels ON i.inhparent = rels.oid
        )
        SELECT EXISTS (
            SELECT 1 FROM pg_index x JOIN rels ON x.indrelid = rels.oid
             WHERE x.indisunique
               AND x.indkey::int2[] && ARRAY(SELECT a.attnum FROM pg_attribute a
                                              WHERE a.attrelid = x.indrelid AND a.attname = ANY(%s)))
        """,
        (oid, list(written)),
    ).fetchone()
    return bool(row and row[0])


def writing_batch_begin(disable_triggers: bool, lock_wait: float | None = None,
                        settings: Sequence[sql.Composable] = ()) -> sql.Composed:
    """The BEGIN of every transaction that writes a batch, with its ``SET LOCAL``s, as one
    statement string (one round trip; no parameters, so several statements may be sent).

    ``settings``: the drain's own ``SET LOCAL``s (nothing pinrotate sets outlives its transaction:
    behind a transaction pooler the server connection is the application's next).
    ``lock_wait``: this transaction's lock_timeout in seconds (None: as ``settings`` say).
    ``disable_triggers``: the table's ordinary triggers do not fire for this transaction only
    (SET LOCAL ends with it, commit or rollback). An error here aborts the batch: fail closed.
    """
    # READ COMMITTED whatever the database's default_transaction_isolation: the row-version and
    # compare-and-swap guards rely on its re-check of a row an application committed meanwhile
    # (under REPEATABLE READ that is a serialization failure).
    parts: list[sql.Composable] = [sql.SQL("BEGIN ISOLATION LEVEL READ COMMITTED"), *settings]
    if lock_wait is not None:
        parts.append(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{max(1, int(lock_wait * 1000))}ms")))
    if disable_triggers:
        parts.append(sql.SQL("SET LOCAL session_replication_role = replica"))
    return sql.SQL("; ").join(parts)


def relation_text(conn: PgConnection, schema: str | None, table_name: str) -> str:
    """``schema.table`` (or ``table``) quoted as the server reads a relation name."""
    relation = sql.Identifier(schema, table_name) if schema else sql.Identifier(table_name)
    return relation.as_string(conn)


class PgCatalog:
    """``base.catalog.Catalog`` over the pieces above: the facts, no rules."""

    def read_table(self, conn: PgConnection, schema: str | None, table_name: str, *, select: Sequence[str] = (),
                   update: Sequence[str] = ()) -> TableCatalog | None:
        where = f"{schema}.{table_name}" if schema else table_name
        try:
            found = table(conn, relation_text(conn, schema, table_name))
            if found is None:
                return None
            names = conn.execute("SELECT n.nspname::text, c.relname::text FROM pg_class c"
                                 " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s",
                                 (found.oid,)).fetchone()
            assert names is not None
            wanted = [(c, "SELECT") for c in select] + [(c, "UPDATE") for c in update]
            missing, role = missing_privileges(conn, found.oid, wanted)
            triggers = update_triggers(conn, found.oid, list(update))
            security = row_security(conn, found.oid)
        except psycopg.Error as e:
            raise DatabaseError(f"table {where}: cannot read the catalog ({type(e).__name__})") from None
        read_only = tuple(why for why, on in (("pg_is_in_recovery()", found.in_recovery),
                                              ("transaction_read_only = on", found.read_only)) if on)
        notes = tuple(f"column {c} is {why}" for c, why in found.unwritable.items())
        if security is not None:
            notes += (f"row-level security applies to role {security.role}",)
        return TableCatalog(str(names[0]), str(names[1]), found.columns, found.primary_key,
                            tuple(UpdateTrigger(t.name, t.relation, "BEFORE" if t.before else "AFTER")
                                  for t in triggers if t.mode in FIRES_NORMALLY),
                            role, missing, read_only, notes)


CATALOG = PgCatalog()
