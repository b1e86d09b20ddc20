"""The write guard's statements on MySQL / MariaDB: compare-and-swap on the values read (there is
no ``xmin``), for every scheme.

A batch is read without locks (keyset order by id). Its write is one short transaction: lock the
rows read ``FOR UPDATE SKIP LOCKED`` (a row an application holds is skipped, never waited on);
only rows still holding the values read are written, by one UPDATE that compares them (``<=>`` on
the exact bytes) under that lock; every column the server rewrites by itself (``ON UPDATE
CURRENT_TIMESTAMP``) is set to itself in that statement, so it keeps its value; what was stored is
read back and compared before the caller commits.

Four statements a batch when nothing is in the way: the lock (a count of the rows locked), a
savepoint, the UPDATE (its count of rows matched says every locked row still held the values
read) and the read-back (compared in the server: one row back). Anything else (a row skipped, a
row changed, a value stored differently) takes the slower statements that say which rows: the
rows locked by id; back to the savepoint and every locked row's values read under the lock and
compared here; the values stored read back and compared here.

The rows travel as a table value constructor (``VALUES``: MariaDB, MySQL 8.0.19+; ``UNION ALL``
of one ``SELECT`` a row before), their values inlined as the driver would bind them (text and
bytes as hex, integers as digits): the server parses a hex literal in about a third of the time of
a quoted string, and a ``VALUES`` row in a fraction of the time of a ``SELECT``.
Statements and their results only: which rows are FAILED, CONFLICT or swept is the drain's call.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pymysql

from ..base.catalog import CatalogColumn, TableCatalog
from .connect import MySqlConnection, ServerInfo, is_mariadb, server_info
from .operations import OPERATIONS as ops

BINARY_TYPES = frozenset({"binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"})
TEXT_TYPES = frozenset({"char", "varchar", "tinytext", "text", "mediumtext", "longtext", "enum", "set", "json"})
# The row sources: MariaDB 10.3+ ``VALUES (..), (..)``; MySQL 8.0.19+ ``VALUES ROW(..), ROW(..)``;
# any server: ``SELECT .. UNION ALL SELECT ..`` (one SELECT a row, each parsed and optimised alone).
ROW_FORMS = ("values", "values_row", "union")
SAVEPOINT = "pinrotate_cas"


def row_form(server: ServerInfo) -> str:
    """The cheapest row source ``server`` parses (see ``ROW_FORMS``)."""
    if server.flavour == "mariadb":
        return "values" if server.version >= (10, 3, 3) else "union"
    return "values_row" if server.version >= (8, 0, 19) else "union"


def row_source(form: str, names: Sequence[str], rows: Sequence[str]) -> str:
    """A derived table of ``rows`` (each its values' SQL, comma-separated) with columns ``names``:
    a header row that yields nothing names the columns (MariaDB's ``VALUES`` names them after the
    first row's values, MySQL's ``column_0``..), then the rows."""
    if form not in ROW_FORMS:
        raise ValueError(f"unknown row source form {form!r}")
    if not rows:
        raise ValueError("a row source needs at least one row")
    head = "SELECT " + ", ".join(f"NULL AS {n}" for n in names) + " FROM DUAL WHERE FALSE UNION ALL "
    if form == "values":
        return head + "VALUES (" + "), (".join(rows) + ")"
    if form == "values_row":
        return head + "VALUES ROW(" + "), ROW(".join(rows) + ")"
    return head + "SELECT " + " UNION ALL SELECT ".join(rows)


@dataclass(frozen=True)
class CasRow:
    """One row to write: its id, the values read (``old``) and the values to store (``new``), one
    per written column, in the guard's column order."""

    row_id: Any
    old: tuple[Any, ...]
    new: tuple[Any, ...]


@dataclass
class CasOutcome:
    written: list[Any] = field(default_factory=list)  # locked, still as read, written
    changed: list[Any] = field(default_factory=list)  # locked, but no longer as read: not written
    skipped: list[Any] = field(default_factory=list)  # not locked: held by someone else, or gone
    # written, but what the server stored is not the new value (a trigger, a truncation): FAILED
    mismatched: list[Any] = field(default_factory=list)
    # what the server stored, written rows (compared in the server: the new values it found, exactly)
    stored: dict[Any, tuple[Any, ...]] = field(default_factory=dict)


def lock_wait_seconds(seconds: float) -> int:
    """``innodb_lock_wait_timeout`` counts whole seconds, at least 1: a wait is rounded up."""
    return max(1, math.ceil(seconds))


def batch_limits(conn: MySqlConnection, lock_wait: float, statement_timeout: float | None = None,
                 idle_timeout: float | None = None) -> dict[str, float | int]:
    """The session variables a batch sets, as PostgreSQL's batch sets ``lock_timeout``,
    ``statement_timeout`` and ``idle_in_transaction_session_timeout``: ``innodb_lock_wait_timeout``
    on either server; on MariaDB ``max_statement_time`` (every statement) and
    ``idle_transaction_timeout`` (the server ends a batch transaction left idle, and it rolls back);
    on MySQL 8 ``max_execution_time`` (milliseconds), which bounds only its SELECTs: MySQL has no
    bound on an UPDATE's time but the lock wait, and no idle-transaction timeout."""
    limits: dict[str, float | int] = {"innodb_lock_wait_timeout": lock_wait_seconds(lock_wait)}
    mariadb = is_mariadb(conn)
    if statement_timeout:
        if mariadb:
            limits["max_statement_time"] = float(statement_timeout)
        else:
            limits["max_execution_time"] = max(1, math.ceil(statement_timeout * 1000))
    if idle_timeout and mariadb:
        limits["idle_transaction_timeout"] = max(1, math.ceil(idle_timeout))
    return limits


class CommitOutcomeUnknown(Exception):
    """The connection was lost while the batch's COMMIT was in flight: the server may have committed
    the transaction or not, and nobody can say which from this side. Never a rollback to report."""

    def __init__(self, cause: pymysql.err.MySQLError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def start_batch(conn: MySqlConnection, lock_wait: float, statement_timeout: float | None = None,
                idle_timeout: float | None = None) -> tuple[str, ...]:
    """START TRANSACTION of one batch, READ COMMITTED (no gap locks on ids that are gone), under the
    session limits of ``batch_limits``; the names of the limits set, for ``end_batch``."""
    limits = batch_limits(conn, lock_wait, statement_timeout, idle_timeout)
    with conn.cursor() as cur:
        # SET TRANSACTION (no SESSION) applies to the next transaction only.
        cur.execute("SET SESSION " + ", ".join(f"{name} = %s" for name in limits), tuple(limits.values()))
        try:
            cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            cur.execute("START TRANSACTION")
        except BaseException:
            end_batch(conn, tuple(limits))
            raise
    return tuple(limits)


def end_batch(conn: MySqlConnection, limits: tuple[str, ...]) -> None:
    """The session limits ``start_batch`` set back to their defaults: nothing set outlives a batch
    (a connection the server ended has none left)."""
    if conn.open and limits:
        with conn.cursor() as cur:
            cur.execute("SET SESSION " + ", ".join(f"{name} = DEFAULT" for name in limits))


def commit_batch(conn: MySqlConnection) -> None:
    """COMMIT; ``CommitOutcomeUnknown`` when the connection is lost during the COMMIT itself."""
    try:
        conn.commit()
    except pymysql.err.MySQLError as e:
        if conn.open:
            raise  # the server answered: rolled back
        raise CommitOutcomeUnknown(e) from e


@contextlib.contextmanager
def batch_transaction(conn: MySqlConnection, lock_wait: float, statement_timeout: float | None = None,
                      idle_timeout: float | None = None) -> Iterator[None]:
    """One transaction per batch (``start_batch``); committed when the block ends, rolled back on
    any error (``CommitOutcomeUnknown`` when the connection is lost during the COMMIT itself). The
    limits are reset when it ends (``end_batch``)."""
    limits = start_batch(conn, lock_wait, statement_timeout, idle_timeout)
    try:
        try:
            yield
        except BaseException:
            if conn.open:  # a session the server ended (idle_transaction_timeout) rolled back with it
                conn.rollback()
            raise
        commit_batch(conn)
    finally:
        end_batch(conn, limits)


def _literal(conn: MySqlConnection, value: Any) -> str:
    """``value`` as the driver would bind it, in the form the server parses fastest: text as the
    hex of its UTF-8 bytes (a binary string: the statements convert it where a column is text),
    bytes as hex, integers as digits, NULL; anything else as PyMySQL escapes it."""
    kind = type(value)
    if kind is str:
        return f"X'{value.encode().hex()}'"
    if kind is int:
        return str(value)
    if value is None:
        return "NULL"
    if kind is bytes or kind is bytearray:
        return f"X'{value.hex()}'"
    return str(conn.escape(value))


def _id_literal(conn: MySqlConnection, value: Any) -> str:
    """An id exactly as the driver binds it (text ids keep the connection's character set and
    collation, so that the primary key is still used to find them)."""
    return str(value) if type(value) is int else str(conn.escape(value))


class MySqlCasGuard:
    """The statements of one target: ``columns`` written (with ``key_version`` set to the current
    version when given), ``stale_where`` (SQL over alias ``t``, no parameters, composed of the
    room's pieces so that a ``%`` in it is doubled) admitting the rows a run may write (stale, in
    scope). Statements with bound parameters run with a parameter tuple; the batch statements
    inline their values (``_literal``) and run without: their fixed text is formatted once here,
    which turns a doubled ``%`` back into one as the driver would. ``server`` picks the row source
    (``row_form``); without it, the first ``write`` asks the server."""

    def __init__(self, table: TableCatalog, id_column: str, columns: Sequence[str], *,
                 key_version: str | None = None, stale_where: str = "TRUE", server: ServerInfo | None = None,
                 form: str | None = None) -> None:
        self.table = table
        self.rel = ops.relation(table.schema, table.table)
        self.rel_t = ops.relation(table.schema, table.table, "t")
        self.id = ops.quote(id_column)
        self.columns: tuple[CatalogColumn, ...] = tuple(table.columns[c] for c in columns)
        self.key_version = key_version
        self.stale_where = stale_where
        # Rewritten by the server on every UPDATE unless set to themselves in the same statement.
        self.kept = [c.name for c in table.auto_updated if c.name not in columns and c.name != key_version]
        if form is not None and form not in ROW_FORMS:
            raise ValueError(f"unknown row source form {form!r}")
        self.form = form or (row_form(server) if server is not None else None)
        width = len(self.columns)
        self._names = ["pinrotate_id", *(f"{p}{i}" for i in range(width) for p in ("o", "n"))]
        self._new_names = ["pinrotate_id", *(f"n{i}" for i in range(width))]
        # The inlined rows: (id, old values, new values), which the rows are built as most cheaply.
        self._grouped_names = ["pinrotate_id", *(f"o{i}" for i in range(width)), *self._new_names[1:]]
        # Fixed texts of the statements run without parameters: a doubled % turned back into one.
        self._id_sql = self.id % ()
        self._lock_from = f"FROM {self.rel_t} WHERE t.{self.id} IN (" % ()

    def needed_privileges(self) -> tuple[list[str], list[str]]:
        """(SELECT, UPDATE) columns the write needs: the kept ``ON UPDATE CURRENT_TIMESTAMP``
        columns too, since setting one to itself is an UPDATE of it (without the privilege the
        server refuses the statement; pinrotate must never write without keeping them)."""
        written = [c.name for c in self.columns] + ([self.key_version] if self.key_version else []) + self.kept
        return list(dict.fromkeys([self.table.primary_key[0], *written])), written

    def read_batch(self, conn: MySqlConnection, lo: Any, hi: Any, size: int,
                   extra: Sequence[str] = ()) -> list[tuple[Any, ...]]:
        """The next ``size`` stale rows after ``lo`` (up to ``hi``) in id order, without row locks:
        (id, the written columns..., ``extra`` expressions...)."""
        conds, params = ops.keyset(ops.column(self.table.primary_key[0], "t"), lo, hi)
        select = [ops.column(self.table.primary_key[0], "t"), *(ops.column(c.name, "t") for c in self.columns), *extra]
        statement = ops.next_batch(select, self.rel_t, [self.stale_where, *conds], ops.column(
            self.table.primary_key[0], "t"))
        with conn.cursor() as cur:
            cur.execute(statement, (*params, size))
            return list(cur.fetchall())

    def _exact(self, column: CatalogColumn, left: str, right: str) -> str:
        """Equal byte for byte, NULL equal to NULL: no collation folds case or trailing blanks."""
        if column.type_name in BINARY_TYPES:
            return ops.null_safe_equal(left, right)
        return ops.null_safe_equal(f"CAST({ops.text_of(left)} AS BINARY)", f"CAST({ops.text_of(right)} AS BINARY)")

    def _value(self, column: CatalogColumn, expr: str) -> str:
        """The value to store in ``column``: a text column takes the characters of the UTF-8 bytes
        sent (``_literal`` sends text as bytes), converted to its own character set by the server."""
        return ops.text_of(expr) if column.type_name in TEXT_TYPES else expr

    def lock_current(self, conn: MySqlConnection, ids: Sequence[Any]) -> dict[Any, tuple[Any, ...] | None]:
        """Lock the rows of ``ids`` that nobody else holds (SKIP LOCKED): their current values, None
        for a row no longer stale or in scope (the application moved or excluded it)."""
        if not ids:
            return {}
        cols = ", ".join(ops.column(c.name, "t") for c in self.columns)
        marks = ", ".join(["%s"] * len(ids))
        with conn.cursor() as cur:
            cur.execute(f"SELECT t.{self.id}, {cols}, ({self.stale_where}) FROM {self.rel_t} "
                        f"WHERE t.{self.id} IN ({marks}) {ops.lock_clause(skip_locked=True)}", tuple(ids))
            return {r[0]: (tuple(r[1:-1]) if r[-1] else None) for r in cur.fetchall()}

    def _update_suffix(self) -> str:
        """The UPDATE after its row source, with ``%s`` for the key version when the guard sets it
        and every ``%`` of a name still doubled."""
        match = [f"t.{self.id} = v.pinrotate_id",
                 *(self._exact(c, ops.column(c.name, "t"), f"v.o{i}") for i, c in enumerate(self.columns))]
        sets = [f"{ops.column(c.name, 't')} = {self._value(c, f'v.n{i}')}" for i, c in enumerate(self.columns)]
        if self.key_version:
            sets.append(f"{ops.column(self.key_version, 't')} = %s")
        # Set to itself: MySQL then leaves an ON UPDATE CURRENT_TIMESTAMP column as it was.
        sets += [f"{ops.column(c, 't')} = {ops.column(c, 't')}" for c in self.kept]
        # The rows to write first, then the table by its primary key (STRAIGHT_JOIN, FORCE INDEX):
        # a multi-table UPDATE locks every row it reads and, unlike a single-table one, does not
        # skip a row another session holds (no semi-consistent read). Joined the other way round,
        # which the optimizer picks when the batch is near the table's size, it would scan the
        # table and wait on the application's rows.
        return (f") AS v STRAIGHT_JOIN {self.rel_t} FORCE INDEX (PRIMARY) "
                f"ON {' AND '.join(match)} SET {', '.join(sets)} WHERE {self.stale_where}")

    def _stored_suffix(self) -> str:
        """The read-back after its row source (as ``_update_suffix``): a plain read in the writing
        transaction (its own rows, locked by it: it never waits) counting the rows that hold
        exactly the new values (and the key version)."""
        same = [self._exact(c, ops.column(c.name, "t"), f"v.n{i}") for i, c in enumerate(self.columns)]
        if self.key_version:
            same.append(ops.null_safe_equal(ops.column(self.key_version, "t"), "%s"))
        return (f") AS v STRAIGHT_JOIN {self.rel_t} FORCE INDEX (PRIMARY) ON t.{self.id} = v.pinrotate_id "
                f"WHERE {' AND '.join(same) or 'TRUE'}")

    def update_statement(self, rows: int, form: str | None = None) -> str:
        """One UPDATE for ``rows`` rows, bound parameters (id, then old and new of each column, a
        row after the other, then the key version when the guard sets it): joined on (id, every
        old value, exactly), still stale. Only rows this transaction has locked may be given."""
        width = len(self.columns)
        row = ", ".join(["%s"] * (1 + 2 * width))
        return "UPDATE (" + row_source(form or self.form or "union", self._names, [row] * rows) + self._update_suffix()

    def _form(self, conn: MySqlConnection) -> str:
        if self.form is None:
            self.form = row_form(server_info(conn))
        return self.form

    def _fixed(self, text: str, key_version_sql: str | None) -> str:
        """A statement's fixed text for a run without parameters: ``%%`` back to ``%`` and the key
        version (a literal) in place of its ``%s``, as the driver would bind them."""
        return text % ((key_version_sql,) if self.key_version else ())

    def write(self, conn: MySqlConnection, rows: Sequence[CasRow], key_version: int | None = None) -> CasOutcome:
        """Write ``rows`` in the caller's open transaction (``batch_transaction``); never waits on a
        row an application holds. The caller commits only after checking ``mismatched`` is empty
        (and whatever else it verifies in ``stored``)."""
        outcome = CasOutcome()
        if not rows:
            return outcome
        if self.key_version and key_version is None:
            raise ValueError(f"the guard sets {self.key_version}: a key version is needed")
        form = self._form(conn)
        kv_sql = _literal(conn, key_version) if self.key_version else None
        locked = self._lock(conn, rows)
        held = list(rows)
        if locked is not None:
            held = [r for r in rows if r.row_id in locked]
            outcome.skipped = [r.row_id for r in rows if r.row_id not in locked]
        if not held:
            return outcome
        with conn.cursor() as cur:
            cur.execute(f"SAVEPOINT {SAVEPOINT}")
            source, stored_source = self._sources(conn, form, held)
            update = self._fixed(self._update_suffix(), kv_sql)
            due = held
            # Rows matched: SQLAlchemy's PyMySQL connections count rows found, not rows changed
            # (a count of rows changed can only be lower, which takes the exact path below).
            if cur.execute("UPDATE (" + source + update) != len(held):
                # Some row no longer holds the values read, or is no longer stale: undo the UPDATE
                # and find which, under the locks this transaction keeps.
                cur.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
                current = self.lock_current(conn, [r.row_id for r in held])
                due = []
                for r in held:
                    if current.get(r.row_id) != tuple(r.old):  # None too: no longer stale or in scope
                        outcome.changed.append(r.row_id)
                    else:
                        due.append(r)
                if not due:
                    return outcome
                source, stored_source = self._sources(conn, form, due)
                cur.execute("UPDATE (" + source + update)
            cur.execute("SELECT COUNT(*) FROM (" + stored_source + self._fixed(self._stored_suffix(), kv_sql))
            found = cur.fetchone()
        if found is not None and found[0] == len(due):  # every row holds exactly what was sent
            extra = (key_version,) if self.key_version else ()
            outcome.written = [r.row_id for r in due]
            outcome.stored = {r.row_id: (*r.new, *extra) for r in due}
            return outcome
        outcome.stored = self.read_back(conn, [r.row_id for r in due])
        for r in due:
            stored = outcome.stored.get(r.row_id)
            kv_ok = not self.key_version or (stored is not None and stored[-1] == key_version)
            if stored is not None and stored[:len(self.columns)] == tuple(r.new) and kv_ok:
                outcome.written.append(r.row_id)
            else:
                outcome.mismatched.append(r.row_id)
        return outcome

    def _lock(self, conn: MySqlConnection, rows: Sequence[CasRow]) -> set[Any] | None:
        """Lock ``rows`` that nobody else holds (SKIP LOCKED): None when all of them were (a count
        says so), else the ids of those locked (read again: a transaction's own locks are never
        skipped)."""
        ids = ", ".join([_id_literal(conn, r.row_id) for r in rows])
        where = f"{self._lock_from}{ids}) {ops.lock_clause(skip_locked=True)}"
        with conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) " + where)
            row = cur.fetchone()
            if row is not None and row[0] == len(rows):
                return None
            cur.execute(f"SELECT t.{self._id_sql} " + where)
            return {r[0] for r in cur.fetchall()}

    def _sources(self, conn: MySqlConnection, form: str, rows: Sequence[CasRow]) -> tuple[str, str]:
        """The rows as two row sources: for the UPDATE (id, the old values, the new values) and for
        the read-back (id, the new values; the old ones would only cost the server parsing)."""
        full, new_only = [], []
        width = len(self.columns)
        for r in rows:
            old, new = r.old, r.new
            if len(old) != width or len(new) != width:
                raise ValueError(f"row {r.row_id!r}: {width} old and {width} new values are needed")
            row_id = _id_literal(conn, r.row_id)
            olds = ", ".join([_literal(conn, v) for v in old])
            news = ", ".join([_literal(conn, v) for v in new])
            full.append(f"{row_id}, {olds}, {news}")
            new_only.append(f"{row_id}, {news}")
        return row_source(form, self._grouped_names, full), row_source(form, self._new_names, new_only)

    def read_back(self, conn: MySqlConnection, ids: Sequence[Any]) -> dict[Any, tuple[Any, ...]]:
        """What the server stored for ``ids`` (the written columns, then the key version), read in
        the writing transaction: its own rows, locked by it, so a plain read (which never waits;
        a locking read may scan and wait on rows of others) sees what it wrote."""
        if not ids:
            return {}
        names = [c.name for c in self.columns] + ([self.key_version] if self.key_version else [])
        marks = ", ".join(["%s"] * len(ids))
        with conn.cursor() as cur:
            cur.execute(f"SELECT {self.id}, {', '.join(map(ops.quote, names))} FROM {self.rel} "
                        f"WHERE {self.id} IN ({marks})", tuple(ids))
            return {r[0]: tuple(r[1:]) for r in cur.fetchall()}
