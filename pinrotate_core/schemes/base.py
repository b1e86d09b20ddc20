"""The Scheme protocol: everything the generic drain and inventory may ask of a ciphertext scheme.

A scheme knows its values (parse and classify them: category + key), which rows are stale, how to
plan a batch (pure: rows in, writes and failures out; no SQL of its own, no I/O but the Rewrapper
port of server-side schemes), which write guard it needs (a row lock, or compare-and-swap on the
value read), and how long a value becomes once rewritten (capacity). It never imports the drain,
the inventory or a key provider.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, runtime_checkable

from psycopg import sql

from ..targets import Column, ResolvedTarget

DECRYPT_FAILED: Final = "decrypt_failed"
UNKNOWN_KEY: Final = "unknown_key"

# Inventory categories (contract §6).
CATEGORIES: Final = ("ACTIVE", "HISTORICAL", "NEWER", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "EXCLUDED", "FAILED",
                     "CONFLICT", "BLOCKED")
STALE: Final = frozenset({"HISTORICAL", "LEGACY", "UNKNOWN_KEY"})
LEGACY_KEY: Final = "legacy"

# "lock": rows are locked FOR NO KEY UPDATE SKIP LOCKED when read, and written while locked.
# "cas": rows are read without locks; each column is written only where it still holds the value
#        read (compare-and-swap); a miss is a CONFLICT unless the value is already settled.
WriteGuard = Literal["lock", "cas"]


@dataclass(frozen=True)
class ValueClass:
    """The category of one value and the key it names (a key id, ``legacy``, or None when UNKNOWN)."""

    category: str
    key: str | None = None


UNKNOWN_VALUE: Final = ValueClass("UNKNOWN")


@dataclass(frozen=True)
class FailedRow:
    """A row left unchanged. Carries locations only: never a value."""

    target: str
    id: str
    columns: tuple[str, ...]
    reason: str = DECRYPT_FAILED

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "id": self.id, "columns": list(self.columns), "reason": self.reason}


@dataclass
class Write:
    """One set-based statement of a batch: set ``columns`` (indexes into the target's cipher columns)
    of the rows ``ids`` to ``new`` (one list per column). With the ``cas`` guard, ``old`` holds the
    values read, and a row is written only where every listed column still holds them."""

    columns: tuple[int, ...]
    ids: list[Any] = field(default_factory=list)
    new: list[list[Any]] = field(default_factory=list)
    old: list[list[Any]] = field(default_factory=list)
    weights: list[int] = field(default_factory=list)  # values re-encrypted per row
    tenants: list[str] = field(default_factory=list)  # cas: whose row it is (CONFLICT records)

    def __post_init__(self) -> None:
        self.new = self.new or [[] for _ in self.columns]
        self.old = self.old or [[] for _ in self.columns]

    def add(self, row_id: Any, new: Sequence[Any], old: Sequence[Any] = (), weight: int = 1, tenant: str = "") -> None:
        self.ids.append(row_id)
        for values, value in zip(self.new, new):
            values.append(value)
        for values, value in zip(self.old, old):
            values.append(value)
        self.weights.append(weight)
        self.tenants.append(tenant)


@dataclass
class BatchPlan:
    """What one batch writes and what it leaves alone (failed rows, counts of values skipped)."""

    writes: list[Write] = field(default_factory=list)
    failed: list[FailedRow] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # e.g. active, unknown, unknown_key, legacy_left
    skipped: int = 0  # rows already known to fail in this run, not tried again

    @property
    def planned(self) -> int:
        """Values (or rows, for row-counting schemes) this batch re-encrypts if nobody interferes."""
        return sum(sum(w.weights) for w in self.writes)

    @property
    def ids(self) -> list[Any]:
        """Ids of the rows written (in order, each once)."""
        return list(dict.fromkeys(i for w in self.writes for i in w.ids))

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


@runtime_checkable
class Rewrapper(Protocol):
    """The port of server-side schemes (vault-transit): a batch rewrap, order preserved.

    ``rewrap`` raises ``TransitValuesInvalid`` (positions of refused values) or ``KeyUnavailable``.
    """

    description: str

    def rewrap(self, values: Sequence[str]) -> list[str]: ...


class RowLocked:
    """What row-locked, row-counting schemes (``aesgcm``, ``vault-transit``) share: rows are locked
    while read and written, each stale row counts once."""

    guard: WriteGuard = "lock"
    counts_values = False

    def inventory_facts(self) -> dict[str, Any]:
        return {}

    def drift_condition(self, alias: str) -> sql.Composable | None:
        return None


class Scheme(Protocol):
    """One ciphertext scheme bound to one resolved target and the run's keyring."""

    name: str
    guard: WriteGuard
    counts_values: bool  # True: reports count values (fpc1, with stale_values: drain.counting); False: rows
    target: ResolvedTarget
    current_key: str

    def stale_condition(self, alias: str | None = None) -> sql.Composable:
        """SQL, without parameters: rows that may hold a value to move to the current key."""

    def read_list(self, alias: str | None = None) -> list[sql.Composable]:
        """What the drain reads per row after the id (the plan's ``row[1:]``)."""

    def plan(self, rows: Sequence[Sequence[Any]], known_failed: Collection[str] = ()) -> BatchPlan:
        """The writes for ``rows`` = ``(id, *read_list)``; every new value verified before it is returned."""

    def value_keys_sql(self, alias: str) -> list[tuple[sql.Composable, sql.Composable]] | None:
        """Per value of a row: (key as text, present) in SQL, for a counting inventory; None: stream."""

    def classify_key(self, key: str | None) -> ValueClass:
        """The category of a value on ``key`` (None: not readable as this scheme)."""

    def inspect(self, row: Sequence[Any], deep: bool) -> Iterator[tuple[ValueClass, bool]]:
        """Every value of a row read with ``read_list``: its class and, when ``deep``, whether it fails
        to decrypt. Row-counting schemes yield one entry per row."""

    def growth(self, column: Column) -> int:
        """The most characters a value of ``column`` can gain when rewritten (a SQL pre-filter)."""

    def length_after(self, column: Column, stored: Any) -> int | None:
        """Characters a stored value of ``column`` will have once rewritten; None: never rewritten."""

    def inventory_facts(self) -> dict[str, Any]:
        """Scheme facts the inventory reports as they are (e.g. Transit's latest version)."""

    def drift_condition(self, alias: str) -> sql.Composable | None:
        """Rows the drain would not select although a value is stale (counted, reported); None: none."""
