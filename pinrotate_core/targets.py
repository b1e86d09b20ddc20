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
from .engines.postgresql import catalog as pg_catalog
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


def _refuse_percent_names(t: TargetSettings) -> None:
    """A run's statements carry bound parameters, and psycopg reads a ``%`` in a quoted name as a
    placeholder: a run on such a name would fail in its first batch with an error that names no
    column. BLOCKED before anything runs, naming the names (the MySQL room writes them doubled)."""
    names = [t.table, t.id, *t.columns, t.key_version, t.tenant, t.soft_delete, *t.require_not_null]
    found = sorted({n for n in names if n and "%" in n})
    if found:
        raise TargetBlocked(t.name, f"a '%' in a name is not supported on PostgreSQL yet: {', '.join(found)}")


def resolve_target(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings, *,
                   writing: bool = True, reads_versions: bool = False) -> ResolvedTarget:
    """Check ``t`` against the catalog (the PostgreSQL room's ``catalog`` pieces); raise
    TargetBlocked naming what is wrong.

    ``writing``: a run (UPDATE privilege, a writable connection, triggers it may silence); an
    inventory or a gate asks only what reading needs. ``reads_versions``: the run also reads each
    row's version (``ROW_VERSION_COLUMNS``), a privilege a column grant must name.
    """
    if writing:
        _refuse_percent_names(t)
    relation = relation_of(t)
    regname = relation.as_string(conn)
    try:
        found = pg_catalog.table(conn, regname)
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the catalog ({type(e).__name__})") from None
    if found is None:
        raise TargetBlocked(t.name, f"table {t.table} does not exist")
    if writing and (found.in_recovery or found.read_only):
        raise TargetBlocked(t.name, "the database connection is read-only")
    oid = found.oid
    cols = {name: Column(c.name, c.sql_type, c.type_name, c.char_length) for name, c in found.columns.items()}
    unwritable = found.unwritable  # column -> why no UPDATE may set it

    id_column, key_version, cipher_cols = check_shape(t, cols, found.primary_key, POSTGRESQL_TYPES)
    written = [c.name for c in cipher_cols] + ([key_version.name] if key_version else [])
    by_ctid, inherited = found.by_ctid, found.inherited
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
    """BLOCKED unless the role may SELECT every column it reads and UPDATE every column it writes
    (column by column: a column grant is enough). An inventory or a gate writes nothing: it asks
    for SELECT only (``written`` empty).
    """
    wanted = [(c, "SELECT") for c in [*read_columns(t), *system]] + [(c, "UPDATE") for c in written]
    try:
        lacking, role = pg_catalog.missing_privileges(conn, oid, wanted)
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the column privileges ({type(e).__name__})") from None
    if lacking:
        raise TargetBlocked(t.name, lacking_privileges(role, t.table, lacking))


def lacking_privileges(role: str, table: str, lacking: Sequence[tuple[str, str]]) -> str:
    """The one line, on every engine, naming what ``role`` lacks on ``table``: ``lacking`` is
    (privilege, column) pairs, said per privilege in their order."""
    missing: dict[str, list[str]] = {}
    for privilege, column in lacking:
        missing.setdefault(privilege, []).append(column)
    grants = "; ".join(f"{p} ({', '.join(cols)})" for p, cols in missing.items())
    return f"role {role} lacks {grants} on {table} (python -m flows.rotate grants prints the GRANT statements)"


def _check_row_security(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings, oid: object) -> None:
    """BLOCKED when row-level security applies to the connecting role on the table.

    Counts and the drain's selection would then see only what the policies show, and the gate could
    open while hidden rows are still on the key.
    """
    try:
        security = pg_catalog.row_security(conn, oid)
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the catalog ({type(e).__name__})") from None
    if security is None:
        return
    why = ("it owns the table, but FORCE ROW LEVEL SECURITY is set" if security.owner and security.forced
           else "it has neither BYPASSRLS nor ownership of the table")
    raise TargetBlocked(t.name, f"row-level security on {t.table} applies to role {security.role} ({why}): counts "
                                "and re-encryption would see only the rows its policies show; run as a role with "
                                "BYPASSRLS")


def _check_triggers(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings, oid: object,
                    written: list[str], *, writing: bool = True) -> bool:
    """Apply the target's ``triggers`` setting to the table's UPDATE triggers and ON UPDATE rules
    (``pg_catalog.update_triggers``); True when batches must run with triggers disabled.
    ``session_replication_role = replica`` silences only those that fire in the normal mode ('O').
    """
    try:
        rows = pg_catalog.update_triggers(conn, oid, written)
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the catalog ({type(e).__name__})") from None
    if t.triggers == "fire":
        return False

    def names(modes: str) -> list[str]:
        return [r.name if r.on_table else f"{r.relation}.{r.name}" for r in rows if r.mode in modes]

    if t.triggers == "block":
        firing = names(pg_catalog.FIRES_NORMALLY)
        if firing:
            what = "UPDATE triggers or rules" if any(n.startswith("rule ") for n in firing) else "UPDATE triggers"
            raise TargetBlocked(t.name, f"{t.table} has {what} that re-encryption would fire: "
                                        f"{', '.join(firing)}; set triggers = \"disable\" or \"fire\" on the target")
        return False
    # "disable": session_replication_role = replica silences 'O' triggers only.
    still_firing = names(pg_catalog.FIRES_UNDER_REPLICA_ROLE)
    if still_firing:
        raise TargetBlocked(t.name, f"triggers = \"disable\" cannot silence {', '.join(still_firing)} on {t.table} "
                                    "(ENABLE ALWAYS or ENABLE REPLICA triggers fire under session_replication_role "
                                    "= replica)")
    if not writing:
        return True  # whether this role may silence them matters only to a run that writes
    try:
        role = pg_catalog.current_role(conn)
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the current role ({type(e).__name__})") from None
    try:
        allowed = pg_catalog.may_silence_triggers(conn)
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot check session_replication_role ({type(e).__name__})") from None
    if not allowed:
        raise TargetBlocked(t.name, f"triggers = \"disable\": role {role} may not set session_replication_role "
                                    "(it needs superuser, or on PostgreSQL 15+ GRANT SET ON PARAMETER "
                                    "session_replication_role)")
    return True


def _in_unique_index(conn: psycopg.Connection[tuple[object, ...]], t: TargetSettings, oid: object,
                     written: list[str]) -> bool:
    """Is a column of ``written`` in a unique index of the table or of one of its partitions or
    inheritance children (PostgreSQL then takes a key update's FOR UPDATE lock for the row)?"""
    try:
        return pg_catalog.in_unique_index(conn, oid, written)
    except psycopg.Error as e:
        raise DatabaseError(f"target {t.name}: cannot read the catalog ({type(e).__name__})") from None


def row_lock(target: ResolvedTarget) -> sql.SQL:
    """The row lock a write that must never wait takes (with SKIP LOCKED) before it writes."""
    return sql.SQL("FOR UPDATE" if target.key_update else "FOR NO KEY UPDATE")


def writing_batch_begin(target: ResolvedTarget, lock_wait: float | None = None,
                        settings: Sequence[sql.Composable] = ()) -> sql.Composed:
    """The BEGIN of every transaction that writes a batch of ``target`` (the room's
    ``writing_batch_begin``; ``triggers = "disable"``: with ``session_replication_role = replica``)."""
    return pg_catalog.writing_batch_begin(target.disable_triggers, lock_wait, settings)
