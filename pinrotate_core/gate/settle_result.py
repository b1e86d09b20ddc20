"""What waiting before an open verdict came to: ok, or closed with one reason and blocking counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NAMED = 3  # sessions, standbys or gids a reason names before "and N more"


@dataclass
class SettleResult:
    ok: bool
    reason: str | None = None
    blocking: dict[str, int] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)  # names, pids, LSNs, durations: never a query text

    @classmethod
    def closed(cls, category: str, n: int, reason: str, facts: dict[str, Any]) -> SettleResult:
        return cls(False, reason, {category: max(n, 1)}, {**facts, "reason": reason})


def named(items: list[str]) -> str:
    """The first few of ``items``, then how many more."""
    more = f" and {len(items) - NAMED} more" if len(items) > NAMED else ""
    return ", ".join(items[:NAMED]) + more
