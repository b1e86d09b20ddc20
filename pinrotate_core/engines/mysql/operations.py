"""MySQL / MariaDB SQL pieces (``base.operations``): backtick quoting, ``CAST(... AS CHAR)``,
``REGEXP``, ``X'..'`` literals, ``<=>``, keyset and ``FOR UPDATE SKIP LOCKED`` clauses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class MySqlOperations:
    def quote(self, name: str) -> str:
        if not name or "\x00" in name:
            raise ValueError("an identifier is empty or holds a NUL character")
        return "`" + name.replace("`", "``") + "`"

    def relation(self, schema: str | None, table: str, alias: str | None = None) -> str:
        rel = f"{self.quote(schema)}.{self.quote(table)}" if schema else self.quote(table)
        return f"{rel} AS {self.quote(alias)}" if alias else rel

    def column(self, name: str, alias: str | None = None) -> str:
        return f"{self.quote(alias)}.{self.quote(name)}" if alias else self.quote(name)

    def text_of(self, expr: str) -> str:
        # utf8mb4 explicitly: a latin1 or binary column compares as the characters it holds.
        return f"CONVERT({expr} USING utf8mb4)"

    def regex_match(self, expr: str, pattern_sql: str) -> str:
        # REGEXP is case-insensitive under a _ci collation; BINARY makes it exact, as ~ is.
        return f"CAST({expr} AS BINARY) REGEXP BINARY {pattern_sql}"

    def text_literal(self, text: str) -> str:
        return f"CONVERT(X'{text.encode().hex()}' USING utf8mb4)" if text else "''"

    def binary_literal(self, blob: bytes) -> str:
        return f"X'{blob.hex()}'"

    def null_safe_equal(self, left: str, right: str) -> str:
        return f"{left} <=> {right}"

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

    def lock_clause(self, *, skip_locked: bool, of: str | None = None) -> str:
        # MySQL 8 knows FOR UPDATE OF tbl; MariaDB does not: the clause locks every table read.
        return "FOR UPDATE SKIP LOCKED" if skip_locked else "FOR UPDATE"


OPERATIONS = MySqlOperations()
