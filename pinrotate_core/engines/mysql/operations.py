"""MySQL / MariaDB SQL pieces (``base.operations``): backtick quoting, ``CONVERT(... USING
utf8mb4)``, ``REGEXP``, ``X'..'`` literals, ``<=>`` and ``FOR UPDATE SKIP LOCKED``."""

from __future__ import annotations

from ..base.operations import StandardClauses


class MySqlOperations(StandardClauses):
    def quote(self, name: str) -> str:
        if not name or "\x00" in name:
            raise ValueError("an identifier is empty or holds a NUL character")
        return ("`" + name.replace("`", "``") + "`").replace("%", "%%")

    def text_of(self, expr: str) -> str:
        # utf8mb4 explicitly: a latin1 or binary column compares as the characters it holds.
        return f"CONVERT({expr} USING utf8mb4)"

    def regex_match(self, expr: str, pattern: str) -> str:
        # REGEXP folds case under a _ci collation; utf8mb4_bin makes it exact, as ~ is. (Not a
        # BINARY cast: MySQL 8's ICU regular expressions refuse binary strings.) PCRE and ICU read
        # a final '$' as "at the end or before a final newline": '\z' is the end only, in both.
        if pattern.endswith("$") and not pattern.endswith("\\$"):
            pattern = pattern[:-1] + "\\z"
        return f"{self.text_of(expr)} COLLATE utf8mb4_bin REGEXP {self.text_literal(pattern)}"

    def text_literal(self, text: str) -> str:
        return f"CONVERT(X'{text.encode().hex()}' USING utf8mb4)" if text else "''"

    def binary_literal(self, blob: bytes) -> str:
        return f"X'{blob.hex()}'"

    def to_int(self, expr: str) -> str:
        return f"CAST({expr} AS SIGNED)"

    def value_text(self, expr: str, type_name: str) -> str:
        return self.text_of(expr)

    def starts_with(self, text_expr: str, prefix: str) -> str:
        # Bytes, not characters under a collation: a _ci collation would take 'fpc1:' for 'FPC1:'.
        data = prefix.encode()
        return f"LEFT(CAST({text_expr} AS BINARY), {len(data)}) = {self.binary_literal(data)}"

    def before_first(self, text_expr: str, separator: str) -> str:
        return f"SUBSTRING_INDEX({text_expr}, {self.text_literal(separator)}, 1)"

    def null_safe_equal(self, left: str, right: str) -> str:
        return f"{left} <=> {right}"

    def exact_text_equal(self, left: str, right: str) -> str:
        return f"CAST({left} AS BINARY) = CAST({right} AS BINARY)"

    def lock_clause(self, *, skip_locked: bool, of: str | None = None) -> str:
        # MySQL 8 knows FOR UPDATE OF tbl; MariaDB does not: the clause locks every table read.
        return "FOR UPDATE SKIP LOCKED" if skip_locked else "FOR UPDATE"


OPERATIONS = MySqlOperations()
