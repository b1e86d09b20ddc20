"""SQL pieces an engine supplies so that a statement is composed once for every engine (as
``sqlalchemy.sql.compiler`` compiles one construct per dialect): quoting, casts, the keyset and
locking clauses, the regex operator, literals. Pieces are plain strings with ``%s`` placeholders
(both psycopg and PyMySQL bind that style); values are always bound, never inlined, except where a
piece says it inlines a hex literal (no placeholder can hide in hex).

A statement composed of these pieces is always executed WITH a parameter sequence, an empty one
if need be: a ``%`` in a quoted name is doubled (``%%``), which both drivers turn back into one
only when parameters are given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Operations(Protocol):
    def quote(self, name: str) -> str:
        """An identifier, quoted: ``"a""b"`` on PostgreSQL, ```a``b``` on MySQL; ``%`` doubled."""

    def relation(self, schema: str | None, table: str, alias: str | None = None) -> str:
        """``schema.table`` quoted (``AS alias`` appended when given)."""

    def column(self, name: str, alias: str | None = None) -> str:
        """A column reference, ``alias.name`` when aliased."""

    def text_of(self, expr: str) -> str:
        """``expr`` as text (``expr::text`` / ``CAST(expr AS CHAR)``)."""

    def regex_match(self, expr: str, pattern: str) -> str:
        """True when text ``expr`` matches the regular expression ``pattern`` (inlined), case and
        all; a final ``$`` is the end of the text, never before a final newline. Patterns keep to
        what PostgreSQL's, PCRE (MariaDB) and ICU (MySQL 8) read alike: classes, anchors, counts,
        groups."""

    def text_literal(self, text: str) -> str:
        """A text constant inlined as hex, safe in statements with and without bound parameters."""

    def binary_literal(self, blob: bytes) -> str:
        """A binary constant (``'\\x..'::bytea`` / ``X'..'``)."""

    def to_int(self, expr: str) -> str:
        """``expr`` as a 64-bit integer (``::int8`` / ``CAST(.. AS SIGNED)``)."""

    def value_text(self, expr: str, type_name: str) -> str:
        """A stored value of a column of ``type_name`` as text: a binary column's bytes as the
        characters they are (PostgreSQL ``bytea``: escaped where not ASCII, so a pattern fails)."""

    def starts_with(self, text_expr: str, prefix: str) -> str:
        """Text ``text_expr`` begins with ``prefix``, byte for byte (no collation folds case)."""

    def before_first(self, text_expr: str, separator: str) -> str:
        """The part of ``text_expr`` before the first ``separator`` (all of it when there is none)."""

    def null_safe_equal(self, left: str, right: str) -> str:
        """Equal, NULL equal to NULL (``IS NOT DISTINCT FROM`` / ``<=>``)."""

    def exact_text_equal(self, left: str, right: str) -> str:
        """Two texts equal byte for byte (MySQL's collations fold case and trailing blanks)."""

    def keyset(self, id_expr: str, lo: Any, hi: Any) -> tuple[list[str], list[Any]]:
        """Conditions and parameters for ids in ``(lo, hi]``; None: an open end."""

    def next_batch(self, columns: Sequence[str], relation: str, where: Sequence[str], id_expr: str,
                   lock: str = "") -> str:
        """``SELECT columns FROM relation WHERE ... ORDER BY id LIMIT %s`` (+ a locking clause)."""

    def lock_clause(self, *, skip_locked: bool, of: str | None = None) -> str:
        """The row-locking clause of a SELECT that must never wait on an application's row lock
        when ``skip_locked``."""


class StandardClauses:
    """What is standard SQL over an engine's ``quote``: names, the keyset and batch clauses, the
    same text on every engine."""

    def quote(self, name: str) -> str:
        raise NotImplementedError

    def relation(self, schema: str | None, table: str, alias: str | None = None) -> str:
        rel = f"{self.quote(schema)}.{self.quote(table)}" if schema else self.quote(table)
        return f"{rel} AS {self.quote(alias)}" if alias else rel

    def column(self, name: str, alias: str | None = None) -> str:
        return f"{self.quote(alias)}.{self.quote(name)}" if alias else self.quote(name)

    def keyset(self, id_expr: str, lo: Any, hi: Any) -> tuple[list[str], list[Any]]:
        conds: list[str] = []
        params: list[Any] = []
        if lo is not None:
            conds.append(f"{id_expr} > %s")
            params.append(lo)
        if hi is not None:
            conds.append(f"{id_expr} <= %s")
            params.append(hi)
        return conds, params

    def next_batch(self, columns: Sequence[str], relation: str, where: Sequence[str], id_expr: str,
                   lock: str = "") -> str:
        condition = " AND ".join(f"({w})" for w in where) or "TRUE"
        statement = f"SELECT {', '.join(columns)} FROM {relation} WHERE {condition} ORDER BY {id_expr} LIMIT %s"
        return f"{statement} {lock}" if lock else statement
