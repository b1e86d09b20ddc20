"""PostgreSQL SQL pieces (``base.operations``): double-quote quoting, ``::text``, ``~``,
``decode(hex)`` literals, ``IS NOT DISTINCT FROM``, keyset and ``FOR NO KEY UPDATE SKIP LOCKED``
clauses: the same pieces today's statements write by hand (scope.py, drain/)."""

from __future__ import annotations

import re

from ..base.operations import StandardClauses

# Text a plain literal holds as it is, whatever standard_conforming_strings says, and where no
# driver sees a placeholder: printable ASCII but the quote, the backslash and '%'.
_PLAIN = re.compile(r"[\x20-\x24\x26\x28-\x5b\x5d-\x7e]*")


class PostgresOperations(StandardClauses):
    def quote(self, name: str) -> str:
        if not name or "\x00" in name:
            raise ValueError("an identifier is empty or holds a NUL character")
        return ('"' + name.replace('"', '""') + '"').replace("%", "%%")  # as psycopg's sql.Identifier renders it

    def relation(self, schema: str | None, table: str, alias: str | None = None) -> str:
        rel = f"{self.quote(schema)}.{self.quote(table)}" if schema else self.quote(table)
        return f"{rel} AS {self.quote(alias)}" if alias else rel

    def column(self, name: str, alias: str | None = None) -> str:
        return f"{self.quote(alias)}.{self.quote(name)}" if alias else self.quote(name)

    def text_of(self, expr: str) -> str:
        return f"({expr})::text"

    def regex_match(self, expr: str, pattern_sql: str) -> str:
        return f"({expr}) ~ {pattern_sql}"

    def text_literal(self, text: str) -> str:
        # A plain literal is a constant (the scope rule's words and pattern, in every batch's read);
        # any other text (a tenant with a quote, a backslash, a '%' that would read as a
        # placeholder, non-ASCII) is inlined as hex: convert_from is STABLE, evaluated row by row.
        if _PLAIN.fullmatch(text):
            return f"'{text}'"
        return f"convert_from(decode('{text.encode().hex()}', 'hex'), 'UTF8')"

    def binary_literal(self, blob: bytes) -> str:
        return f"decode('{blob.hex()}', 'hex')"

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
