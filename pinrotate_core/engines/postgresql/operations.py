"""PostgreSQL SQL pieces (``base.operations``): double-quote quoting, ``::text``, ``~``,
``decode(hex)`` literals, ``IS NOT DISTINCT FROM``, keyset and ``FOR NO KEY UPDATE SKIP LOCKED``
clauses: the same pieces today's statements write by hand (scope.py, drain/)."""

from __future__ import annotations

from ..base.operations import StandardClauses


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
        # As scope.py inlines a tenant: a '%' in a plain literal would read as a placeholder.
        return f"convert_from(decode('{text.encode().hex()}', 'hex'), 'UTF8')"

    def binary_literal(self, blob: bytes) -> str:
        return f"decode('{blob.hex()}', 'hex')"

    def null_safe_equal(self, left: str, right: str) -> str:
        return f"{left} IS NOT DISTINCT FROM {right}"

    def exact_text_equal(self, left: str, right: str) -> str:
        return f"({left}) = ({right})"  # text compares byte for byte under a deterministic collation

    def lock_clause(self, *, skip_locked: bool, of: str | None = None) -> str:
        # NO KEY UPDATE: a re-encryption changes no key, so foreign keys pointing at the row are not blocked.
        target = f" OF {self.quote(of)}" if of else ""
        return f"FOR NO KEY UPDATE{target}{' SKIP LOCKED' if skip_locked else ''}"


OPERATIONS = PostgresOperations()
