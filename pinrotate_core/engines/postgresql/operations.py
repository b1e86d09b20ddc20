"""PostgreSQL SQL pieces (``base.operations``): double-quote quoting, ``::text``, ``~``,
``decode(hex)`` literals, ``IS NOT DISTINCT FROM``, keyset and ``FOR NO KEY UPDATE SKIP LOCKED``
clauses: the same pieces today's statements write by hand (scope.py, drain/)."""

from __future__ import annotations

import re

from psycopg import sql

from ..base.operations import StandardClauses

# Text a plain literal holds as it is, whatever standard_conforming_strings says, and where no
# driver sees a placeholder: printable ASCII but the quote, the backslash and '%'.
_PLAIN = re.compile(r"[\x20-\x24\x26\x28-\x5b\x5d-\x7e]*")


class PostgresOperations(StandardClauses):
    def quote(self, name: str) -> str:
        if not name or "\x00" in name:
            raise ValueError("an identifier is empty or holds a NUL character")
        return ('"' + name.replace('"', '""') + '"').replace("%", "%%")  # as psycopg's sql.Identifier renders it

    def text_of(self, expr: str) -> str:
        return f"({expr})::text"

    def regex_match(self, expr: str, pattern: str) -> str:
        # ~ reads '$' as the end of the text (no newline-sensitive mode).
        return f"({expr}) ~ {self.text_literal(pattern)}"

    def text_literal(self, text: str) -> str:
        # A plain literal is a constant (the scope rule's words and pattern, in every batch's read);
        # any other text (a tenant with a quote, a backslash, a '%' that would read as a
        # placeholder, non-ASCII) is inlined as hex: convert_from is STABLE, evaluated row by row.
        if _PLAIN.fullmatch(text):
            return f"'{text}'"
        return f"convert_from(decode('{text.encode().hex()}', 'hex'), 'UTF8')"

    def binary_literal(self, blob: bytes) -> str:
        return f"decode('{blob.hex()}', 'hex')"

    def to_int(self, expr: str) -> str:
        return f"({expr})::int8"

    def value_text(self, expr: str, type_name: str) -> str:
        # 'escape' keeps ASCII as it is and escapes anything else (which then fails a pattern);
        # ::text would write a bytea as '\x..' hex.
        return f"encode({expr}, 'escape')" if type_name == "bytea" else self.text_of(expr)

    def starts_with(self, text_expr: str, prefix: str) -> str:
        return f"starts_with({text_expr}, {self.text_literal(prefix)})"

    def before_first(self, text_expr: str, separator: str) -> str:
        return f"split_part({text_expr}, {self.text_literal(separator)}, 1)"

    def null_safe_equal(self, left: str, right: str) -> str:
        return f"{left} IS NOT DISTINCT FROM {right}"

    def exact_text_equal(self, left: str, right: str) -> str:
        # Byte for byte whatever the column's collation: a nondeterministic one (ICU, case-
        # insensitive) would take 'ACME' for 'acme', or refuse to compare with the literal at all.
        return f'({left}) COLLATE "C" = ({right})'

    def lock_clause(self, *, skip_locked: bool, of: str | None = None) -> str:
        # NO KEY UPDATE: a re-encryption changes no key, so foreign keys pointing at the row are not blocked.
        target = f" OF {self.quote(of)}" if of else ""
        return f"FOR NO KEY UPDATE{target}{' SKIP LOCKED' if skip_locked else ''}"


OPERATIONS = PostgresOperations()


def composable(text: str) -> sql.Composable:
    """Text composed of these pieces as psycopg's ``sql.Identifier`` would have written its names,
    for statements that compose it with psycopg: the pieces double a '%' in a quoted name (for
    statements that always run with parameters); psycopg's compositions run with and without them,
    as ``sql.Identifier`` names did (a name with a '%' is BLOCKED for a run, whose statements bind
    parameters; an inventory or a gate reads it). Nothing else of the text holds a '%': a literal
    that would is inlined as hex."""
    return sql.SQL(text.replace("%%", "%"))
