"""Targets: a configured table resolved against the live database before anything is written.

Resolution checks what the migrator must not fix itself (contract §6 BLOCKED): missing table or
column, no single primary key, a read-only connection, missing privileges, an unusable column
type, row-level security that hides rows from the role, UPDATE triggers that a re-encryption would
fire (unless the target's ``triggers`` setting says otherwise). It never runs DDL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from .config import TargetSettings
from .errors import DatabaseError, TargetBlocked

# Column types any scheme may keep ciphertexts in; each scheme narrows them (e.g. fpc1: no bytea).
CIPHER_TYPES = {"bytea", "text", "varchar", "bpchar", "json", "jsonb"}
INTEGER_TYPES = {"int2", "int4", "int8", "numeric"}
# Primary key types the drain pages and shards by: the driver reads and binds them as the server's
# own type, so every range (id > last, a shard's (lo, hi]) is compared by the server's order (a text
# key's collation included). Others (citext, a domain, an enum) would be read back as bare text and
# compared as text, not in the key's order: BLOCKED.
ID_TYPES = {"int2", "int4", "int8", "numeric", "uuid", "text", "varchar", "bpchar"}


@dataclass(frozen=True)
class TypeWords:
    """How an engine names, in a BLOCKED reason, the column types the shape rules accept."""

    id_types: str
    cipher_types: str


POSTGRESQL_TYPES = TypeWords("integer, numeric, uuid and text or varchar", "bytea, text or varchar")


def check_shape(t: TargetSettings, cols: dict[str, Column], pk: Sequence[str],
                words: TypeWords) -> tuple[Column, Column | None, tuple[Column, ...]]:
    """The rules every engine's catalog answers alike (one copy for all of them): a single-column
    primary key that is the id, every configured column present and of a type pinrotate can page,
    version and rewrite. (id column, key-version column, cipher columns); else TargetBlocked."""
    if len(pk) != 1:
        raise TargetBlocked(t.name, f"table {t.table} has no single-column primary key")
    if pk[0] != t.id:
        raise TargetBlocked(t.name, f"id column {t.id} is not the primary key of {t.table} (it is {pk[0]})")

    def need(column: str, role: str) -> Column:
        if column not in cols:
            raise TargetBlocked(t.name, f"{role} column {column} does not exist in {t.table}")
        return cols[column]

    id_column = need(t.id, "id")
    if id_column.type_name not in ID_TYPES:
        raise TargetBlocked(t.name, f"id column {t.id} is {id_column.sql_type}: pinrotate pages and shards rows by "
                                    f"the primary key in the server's own order, and supports {words.id_types} "
                                    "keys only")
    key_version = None
    if t.key_version:
        key_version = need(t.key_version, "key_version")
        if key_version.type_name not in INTEGER_TYPES:
            raise TargetBlocked(t.name, f"key_version column {t.key_version} is {key_version.sql_type}, not an integer")
    cipher_cols = tuple(need(c, "cipher") for c in t.columns)
    for c in cipher_cols:
        if c.type_name not in CIPHER_TYPES:
            raise TargetBlocked(t.name, f"cipher column {c.name} is {c.sql_type}; expected {words.cipher_types}")
    for name in t.require_not_null:
        need(name, "require_not_null")
    if t.tenant:
        need(t.tenant, "tenant")
    if t.soft_delete:
        need(t.soft_delete, "soft_delete")
    return id_column, key_version, cipher_cols


@dataclass(frozen=True)
class Column:
    name: str
    sql_type: str  # format_type(): e.g. "character varying(255)", "bytea"
    type_name: str  # pg_type.typname: "varchar", "bytea", ...
    char_length: int | None  # declared length of varchar(n) / char(n)


@dataclass(frozen=True)
class ResolvedTarget:
    """A target whose table and columns exist as configured; identifiers ready to compose."""

    settings: TargetSettings
    relation: sql.Identifier
    id_column: Column
    key_version: Column | None
    columns: tuple[Column, ...]
    # triggers = "disable": every writing batch runs SET LOCAL session_replication_role = replica
    # (see ``writing_batch_begin``); checked at resolve time that the role may set it.
    disable_triggers: bool = False
    # A plain table with no inheritance children: a row version is its ``ctid`` and ``xmin`` (the
    # primary key makes its id unique). A partitioned table or a table with inheritance children
    # (``by_ctid`` False) spans several heaps, and an inheritance child's ids may repeat its
    # parent's: a row version is its table's ``tableoid`` too (a ``ctid`` is unique within one heap).
    by_ctid: bool = False
    # A written column (cipher or key version) is in a unique index (of the table or of one of its
    # children): an UPDATE of it is a key update, which conflicts with a foreign key's FOR KEY
    # SHARE lock, so a write that must not wait locks its rows FOR UPDATE, not FOR NO KEY UPDATE.
    key_update: bool = False
    # A table with inheritance children (not a partitioned table): its ids may repeat across the tree.
    inherited: bool = False

    @property
    def name(self) -> str:
        return self.settings.name

    def ident(self, column: str) -> sql.Identifier:
        return sql.Identifier(column)


def relation_of(t: TargetSettings) -> sql.Identifier:
    return sql.Identifier(t.schema_name, t.table_name) if t.schema_name else sql.Identifier(t.table_name)


# The system columns a run reads and compares where its scheme writes by row version
# (compare-and-swap on the row version read: drain/guard_version.py reads them in this order).
# A plain table's row version is its ctid and xmin; ``tableoid`` names the heap of a row of a
# partitioned or inherited table (``ROW_VERSION_COLUMNS`` minus ``PLAIN_TABLE_OMITS``).
ROW_VERSION_COLUMNS = ("tableoid", "ctid", "xmin")
PLAIN_TABLE_OMITS = ("tableoid",)


def row_version_columns(by_ctid: bool) -> tuple[str, ...]:
    """The system columns a row version is read as on a plain table (``by_ctid``) or a tree of tables."""
    return tuple(c for c in ROW_VERSION_COLUMNS if not by_ctid or c not in PLAIN_TABLE_OMITS)


def resolve_target(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings, *,
                   writing: bool = True, reads_versions: bool = False) -> ResolvedTarget:
    """Check ``t`` against the catalog; raise TargetBlocked naming what is wrong.

    ``writing``: a run (UPDATE privilege, a writable connection, triggers it may silence); an
    inventory or a gate asks only what reading needs. ``reads_versions``: the run also reads each
    row's version (``ROW_VERSION_COLUMNS``), a privilege a column grant must name.
    """
    relation = relation_of(t)
    regname = relation.as_string(conn)
    try:
        row = conn.execute(
            "SELECT to_regclass(%s)::oid, pg_is_in_recovery(), current_setting('transaction_read_only')",
            (regname,),
        ).fetchone()
        assert row is not None
        oid, in_recovery, read_only = row
        if oid is None:
            raise TargetBlocked(t.name, f"table {t.table} does not exist")
        if writing and (in_recovery or read_only == "on"):
            raise TargetBlocked(t.name, "the database connection is read-only")
        cols: dict[str, Column] = {}
        unwritable: dict[str, str] = {}  # column -> why no UPDATE may set it
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
            cols[str(name)] = Column(str(name), str(sql_type), str(type_name),
                                     char_len if isinstance(char_len, int) else None)
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
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the catalog ({type(e).__name__})") from None

    pk = [str(c) for c in pk_row[0]] if pk_row and isinstance(pk_row[0], list) else []
    id_column, key_version, cipher_cols = check_shape(t, cols, pk, POSTGRESQL_TYPES)
    written = [c.name for c in cipher_cols] + ([key_version.name] if key_version else [])
    by_ctid, inherited = (bool(kind[0]), bool(kind[1])) if kind else (False, False)
    if writing:
        for name in written:
            if name in unwritable:
                raise TargetBlocked(t.name, f"column {name} of {t.table} is {unwritable[name]}: "
                                            "no UPDATE may set it")
        if inherited and not reads_versions:
            # A compare-and-swap write finds a row by its id: an inheritance child's ids may repeat
            # its parent's (the parent's primary key does not cover them), so a row could receive
            # the value read from another.
            raise TargetBlocked(t.name, f"{t.table} has inheritance children, whose ids the primary key does "
                                        f"not cover; format {t.format} writes a row by its id")
    _check_privileges(conn, t, oid, written if writing else [],
                      list(row_version_columns(by_ctid)) if writing and reads_versions else [])
    # The room a value needs after rewriting depends on the data and the current key:
    # inventory.capacity_blocker checks it (rotation.resolve_all, inventory).
    _check_row_security(conn, t, oid)
    disable_triggers = _check_triggers(conn, t, oid, written, writing=writing)
    return ResolvedTarget(t, relation, id_column, key_version, cipher_cols,
                          disable_triggers=disable_triggers, by_ctid=by_ctid, inherited=inherited,
                          key_update=writing and _in_unique_index(conn, t, oid, written))


def read_columns(t: TargetSettings) -> list[str]:
    """Every column a run or an inventory of ``t`` reads: id, key version, ciphertexts, scope columns."""
    names = [t.id, *([t.key_version] if t.key_version else []), *t.columns, *t.require_not_null,
             *([t.tenant] if t.tenant else []), *([t.soft_delete] if t.soft_delete else [])]
    return list(dict.fromkeys(names))


def _check_privileges(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings, oid: object,
                      written: list[str], system: list[str]) -> None:
    """BLOCKED unless the role may SELECT every column it reads and UPDATE every column it writes.

    Column by column (``has_column_privilege`` is true for a table-wide grant too), so the least
    privilege PostgreSQL offers, ``GRANT SELECT (cols), UPDATE (cols) ON table``, is enough. An
    inventory or a gate writes nothing: it asks for SELECT only (``written`` empty).
    """
    wanted = [(c, "SELECT") for c in [*read_columns(t), *system]] + [(c, "UPDATE") for c in written]
    try:
        rows = conn.execute(
            "SELECT w.col, w.priv, has_column_privilege(%s::oid, w.col, w.priv), current_user::text "
            "FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS w(col, priv, n) ORDER BY w.n",
            (oid, [c for c, _ in wanted], [p for _, p in wanted])).fetchall()
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the column privileges ({type(e).__name__})") from None
    missing: dict[str, list[str]] = {}
    for column, privilege, granted, _ in rows:
        if not granted:
            missing.setdefault(str(privilege), []).append(str(column))
    if missing:
        role = str(rows[0][3])
        grants = "; ".join(f"{p} ({', '.join(cols)})" for p, cols in missing.items())
        raise TargetBlocked(t.name, f"role {role} lacks {grants} on {t.table} "
                                    "(python -m flows.rotate grants prints the GRANT statements)")


def _check_row_security(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings, oid: object) -> None:
    """BLOCKED when row-level security applies to the connecting role on the table.

    Counts and the drain's selection would then see only what the policies show, and the gate could
    open while hidden rows are still on the key. ``row_security_active`` is PostgreSQL's own answer
    (superusers and BYPASSRLS roles bypass; the owner bypasses unless FORCE ROW LEVEL SECURITY).
    """
    try:
        row = conn.execute(
            """
            SELECT row_security_active(c.oid), current_user, r.rolbypassrls,
                   pg_has_role(current_user, c.relowner, 'USAGE'), c.relforcerowsecurity
              FROM pg_class c, pg_roles r
             WHERE c.oid = %s AND r.rolname = current_user
            """,
            (oid,),
        ).fetchone()
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the catalog ({type(e).__name__})") from None
    if row is None or not row[0]:
        return
    _, role, _, owner, forced = row
    why = ("it owns the table, but FORCE ROW LEVEL SECURITY is set" if owner and forced
           else "it has neither BYPASSRLS nor ownership of the table")
    raise TargetBlocked(t.name, f"row-level security on {t.table} applies to role {role} ({why}): counts and "
                                "re-encryption would see only the rows its policies show; run as a role with "
                                "BYPASSRLS")


def _check_triggers(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings, oid: object,
                    written: list[str], *, writing: bool = True) -> bool:
    """Apply the target's ``triggers`` setting; True when batches must run with triggers disabled.

    Looks at the non-internal, enabled UPDATE triggers of the table and of its partitions and
    inheritance children (an UPDATE through the parent fires theirs too), row- and statement-level,
    leaving out ``UPDATE OF`` triggers on columns pinrotate never writes; and ON UPDATE rules of the
    table, which rewrite the UPDATE the same way. ``tgenabled`` / ``ev_enabled``: 'O' fires in the
    normal (origin) mode only, 'R' in replica mode only, 'A' always.
    """
    try:
        rows = conn.execute(
            """
            WITH RECURSIVE rels(oid) AS (
                SELECT %s::oid
                UNION
                SELECT i.inhrelid FROM pg_inherits i JOIN rels ON i.inhparent = rels.oid
            )
            SELECT tg.tgname::text, tg.tgrelid = %s::oid, tg.tgrelid::regclass::text, tg.tgenabled::text
              FROM pg_trigger tg JOIN rels ON tg.tgrelid = rels.oid
             WHERE NOT tg.tgisinternal
               AND (tg.tgtype::int & 16) <> 0          -- TRIGGER_TYPE_UPDATE
               AND tg.tgenabled <> 'D'
               AND (cardinality(tg.tgattr::int2[]) = 0
                    OR tg.tgattr::int2[] && ARRAY(SELECT a.attnum FROM pg_attribute a
                                                   WHERE a.attrelid = tg.tgrelid AND a.attname = ANY(%s)))
            UNION ALL
            SELECT 'rule ' || r.rulename::text, true, r.ev_class::regclass::text, r.ev_enabled::text
              FROM pg_rewrite r
             WHERE r.ev_class = %s::oid AND r.ev_type = '2' AND r.ev_enabled <> 'D'   -- ON UPDATE rules
             ORDER BY 3, 1
            """,
            (oid, oid, written, oid),
        ).fetchall()
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the catalog ({type(e).__name__})") from None
    if t.triggers == "fire":
        return False

    def names(modes: str) -> list[str]:
        return [str(name) if on_target else f"{rel}.{name}" for name, on_target, rel, mode in rows if str(mode) in modes]

    if t.triggers == "block":
        firing = names("OA")
        if firing:
            what = "UPDATE triggers or rules" if any(n.startswith("rule ") for n in firing) else "UPDATE triggers"
            raise TargetBlocked(t.name, f"{t.table} has {what} that re-encryption would fire: "
                                        f"{', '.join(firing)}; set triggers = \"disable\" or \"fire\" on the target")
        return False
    # "disable": session_replication_role = replica silences 'O' triggers only.
    still_firing = names("RA")
    if still_firing:
        raise TargetBlocked(t.name, f"triggers = \"disable\" cannot silence {', '.join(still_firing)} on {t.table} "
                                    "(ENABLE ALWAYS or ENABLE REPLICA triggers fire under session_replication_role "
                                    "= replica)")
    if not writing:
        return True  # whether this role may silence them matters only to a run that writes
    try:
        role_row = conn.execute("SELECT current_user").fetchone()
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the current role ({type(e).__name__})") from None
    role = role_row[0] if role_row else "?"
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("SET LOCAL session_replication_role = replica")
    except psycopg.errors.InsufficientPrivilege:
        raise TargetBlocked(t.name, f"triggers = \"disable\": role {role} may not set session_replication_role "
                                    "(it needs superuser, or on PostgreSQL 15+ GRANT SET ON PARAMETER "
                                    "session_replication_role)") from None
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot check session_replication_role ({type(e).__name__})") from None
    return True


def _in_unique_index(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings, oid: object,
                     written: list[str]) -> bool:
    """Is a column of ``written`` in a unique index of the table or of one of its partitions or
    inheritance children (PostgreSQL then takes a key update's FOR UPDATE lock for the row)?"""
    try:
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
            (oid, written),
        ).fetchone()
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the catalog ({type(e).__name__})") from None
    return bool(row and row[0])


def row_lock(target: ResolvedTarget) -> sql.SQL:
    """The row lock a write that must never wait takes (with SKIP LOCKED) before it writes."""
    return sql.SQL("FOR UPDATE" if target.key_update else "FOR NO KEY UPDATE")


def writing_batch_begin(target: ResolvedTarget, lock_wait: float | None = None,
                        settings: Sequence[sql.Composable] = ()) -> sql.Composed:
    """The BEGIN of every transaction that writes a batch of ``target``, with its ``SET LOCAL``s,
    as one statement string (one round trip; no parameters, so several statements may be sent).

    ``settings``: the drain's own ``SET LOCAL``s (nothing pinrotate sets outlives its transaction:
    behind a transaction pooler the server connection is the application's next).
    ``lock_wait``: this transaction's lock_timeout in seconds (None: as ``settings`` say).
    ``triggers = "disable"``: the target's ordinary triggers do not fire for this transaction only
    (SET LOCAL ends with it, commit or rollback). An error here aborts the batch: fail closed.
    """
    # READ COMMITTED whatever the database's default_transaction_isolation: the row-version and
    # compare-and-swap guards rely on its re-check of a row an application committed meanwhile
    # (under REPEATABLE READ that is a serialization failure).
    parts: list[sql.Composable] = [sql.SQL("BEGIN ISOLATION LEVEL READ COMMITTED"), *settings]
    if lock_wait is not None:
        parts.append(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{max(1, int(lock_wait * 1000))}ms")))
    if target.disable_triggers:
        parts.append(sql.SQL("SET LOCAL session_replication_role = replica"))
    return sql.SQL("; ").join(parts)
