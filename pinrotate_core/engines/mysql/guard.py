"""The write guard's statements on MySQL / MariaDB: compare-and-swap on the values read (there is
no ``xmin``), for every scheme.

A batch is read without locks (keyset order by id). Its write is one short transaction: lock the
rows read ``FOR UPDATE SKIP LOCKED`` (a row an application holds is skipped, never waited on) and
read their current values under that lock; only rows still holding the values read are written,
in one statement that also checks them again (``<=>`` on the exact bytes); every column the
server rewrites by itself (``ON UPDATE CURRENT_TIMESTAMP``) is set to itself in that statement, so
it keeps its value; what was stored is read back for verification before the caller commits.
Statements and their results only: which rows are FAILED, CONFLICT or swept is the drain's call.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..base.catalog import CatalogColumn, TableCatalog
from .connect import MySqlConnection
from .operations import OPERATIONS as ops

BINARY_TYPES = frozenset({"binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"})


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
    stored: dict[Any, tuple[Any, ...]] = field(default_factory=dict)  # read back, written rows


def lock_wait_seconds(seconds: float) -> int:
    """``innodb_lock_wait_timeout`` counts whole seconds, at least 1: a wait is rounded up."""
    return max(1, math.ceil(seconds))


@contextlib.contextmanager
def batch_transaction(conn: MySqlConnection, lock_wait: float) -> Iterator[None]:
    """One transaction per batch, READ COMMITTED (no gap locks on ids that are gone), with this
    session's ``innodb_lock_wait_timeout``; committed when the block ends, rolled back on any
    error. The lock wait is reset when it ends, so nothing set outlives the batch."""
    with conn.cursor() as cur:
        # SET TRANSACTION (no SESSION) applies to the next transaction only.
        cur.execute("SET SESSION innodb_lock_wait_timeout = %s", (lock_wait_seconds(lock_wait),))
        try:
            cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            cur.execute("START TRANSACTION")
            try:
                yield
            except BaseException:
                conn.rollback()
                raise
            conn.commit()
        finally:
            cur.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")


class MySqlCasGuard:
    """The statements of one target: ``columns`` written (with ``key_version`` set to the current
    version when given), ``stale_where`` (SQL over alias ``t``, no parameters, composed of the
    room's pieces so that a ``%`` in it is doubled) admitting the rows a run may write (stale, in
    scope). Every statement runs with a parameter tuple."""

    def __init__(self, table: TableCatalog, id_column: str, columns: Sequence[str], *,
                 key_version: str | None = None, stale_where: str = "TRUE") -> None:
        self.table = table
        self.rel = ops.relation(table.schema, table.table)
        self.rel_t = ops.relation(table.schema, table.table, "t")
        self.id = ops.quote(id_column)
        self.columns: tuple[CatalogColumn, ...] = tuple(table.columns[c] for c in columns)
        self.key_version = key_version
        self.stale_where = stale_where
        # Rewritten by the server on every UPDATE unless set to themselves in the same statement.
        self.kept = [c.name for c in table.auto_updated if c.name not in columns and c.name != key_version]

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

    def update_statement(self, rows: int) -> str:
        """One UPDATE for ``rows`` rows: joined on (id, every old value, exactly), still stale.
        Only rows this transaction has locked may be given (``lock_current``)."""
        width = len(self.columns)
        first = ", ".join(["%s AS pinrotate_id"] + [f"%s AS o{i}, %s AS n{i}" for i in range(width)])
        rest = ", ".join(["%s"] * (1 + 2 * width))
        values = " UNION ALL ".join([f"SELECT {first}"] + [f"SELECT {rest}"] * (rows - 1))
        match = [f"t.{self.id} = v.pinrotate_id",
                 *(self._exact(c, ops.column(c.name, "t"), f"v.o{i}") for i, c in enumerate(self.columns))]
        sets = [f"{ops.column(c.name, 't')} = v.n{i}" for i, c in enumerate(self.columns)]
        if self.key_version:
            sets.append(f"{ops.column(self.key_version, 't')} = %s")
        # Set to itself: MySQL then leaves an ON UPDATE CURRENT_TIMESTAMP column as it was.
        sets += [f"{ops.column(c, 't')} = {ops.column(c, 't')}" for c in self.kept]
        # The rows to write first, then the table by its primary key (STRAIGHT_JOIN, FORCE INDEX):
        # a multi-table UPDATE locks every row it reads and, unlike a single-table one, does not
        # skip a row another session holds (no semi-consistent read). Joined the other way round,
        # which the optimizer picks when the batch is near the table's size, it would scan the
        # table and wait on the application's rows.
        return (f"UPDATE ({values}) AS v STRAIGHT_JOIN {self.rel_t} FORCE INDEX (PRIMARY) "
                f"ON {' AND '.join(match)} SET {', '.join(sets)} WHERE {self.stale_where}")

    def write(self, conn: MySqlConnection, rows: Sequence[CasRow], key_version: int | None = None) -> CasOutcome:
        """Write ``rows`` in the caller's open transaction (``batch_transaction``); never waits on a
        row an application holds. The caller commits only after checking ``mismatched`` is empty
        (and whatever else it verifies in ``stored``)."""
        outcome = CasOutcome()
        current = self.lock_current(conn, [r.row_id for r in rows])
        due: list[CasRow] = []
        for r in rows:
            if r.row_id not in current:
                outcome.skipped.append(r.row_id)
            elif current[r.row_id] != tuple(r.old):  # None too: no longer stale or in scope
                outcome.changed.append(r.row_id)
            else:
                due.append(r)
        if not due:
            return outcome
        params: list[Any] = []
        for r in due:
            params.append(r.row_id)
            for old, new in zip(r.old, r.new, strict=True):
                params += [old, new]
        if self.key_version:
            if key_version is None:
                raise ValueError(f"the guard sets {self.key_version}: a key version is needed")
            params.append(key_version)
        with conn.cursor() as cur:
            cur.execute(self.update_statement(len(due)), params)
        outcome.stored = self.read_back(conn, [r.row_id for r in due])
        for r in due:
            stored = outcome.stored.get(r.row_id)
            kv_ok = not self.key_version or (stored is not None and stored[-1] == key_version)
            if stored is not None and stored[:len(self.columns)] == tuple(r.new) and kv_ok:
                outcome.written.append(r.row_id)
            else:
                outcome.mismatched.append(r.row_id)
        return outcome

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
