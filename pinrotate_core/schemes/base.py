"""The Scheme protocol: everything the generic drain and inventory may ask of a ciphertext scheme.

A scheme knows its values (parse and classify them: category + key), which rows are stale, how to
plan a batch (pure: rows in, writes and failures out; no SQL of its own, no I/O but the Rewrapper
port of server-side schemes), which write guard it needs (a row lock, or compare-and-swap on the
value read), and how long a value becomes once rewritten (capacity). Its class (``SchemeClass``)
checks the target's columns and the keyring when it binds; what only some schemes do is an optional
protocol here, asked with ``isinstance``. It never imports the drain, the inventory or a key provider.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal, Protocol, runtime_checkable

from ..config import KeysSettings
from ..engines.base.operations import Operations
from ..keyring import Keyring, is_version
from ..targets import Column, ResolvedTarget

DECRYPT_FAILED: Final = "decrypt_failed"
# The database stored something other than the value written (a BEFORE UPDATE trigger kept or
# changed it): the row is rolled back within its batch and left as it was, FAILED.
NOT_STORED: Final = "not_stored"
UNKNOWN_KEY: Final = "unknown_key"

# Inventory categories (contract §6).
CATEGORIES: Final = ("ACTIVE", "HISTORICAL", "NEWER", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "EXCLUDED", "FAILED",
                     "CONFLICT", "BLOCKED")
STALE: Final = frozenset({"HISTORICAL", "LEGACY", "UNKNOWN_KEY"})
LEGACY_KEY: Final = "legacy"

# Both read rows without locks.
# "version": each row is written only where it is still the row version read (compare-and-swap on
#            xmin and ctid); a miss is the application's newer row, kept, read again while stale.
# "cas": each column is written only where it still holds the value read (compare-and-swap on
#        values); a miss is a CONFLICT unless the value is already settled.
WriteGuard = Literal["version", "cas"]


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
    # The position of each row in the rows given to ``plan`` (a row is its position there, never
    # its id: an inheritance child's ids may repeat its parent's). None: every row given, in order
    # (a compare-and-swap write, matched by id and value, need not say).
    rows: list[int] | None = None

    def __post_init__(self) -> None:
        self.new = self.new or [[] for _ in self.columns]
        self.old = self.old or [[] for _ in self.columns]

    def add(self, row_id: Any, new: Sequence[Any], old: Sequence[Any] = (), weight: int = 1, tenant: str = "",
            row: int | None = None) -> None:
        self.ids.append(row_id)
        if row is not None:
            if self.rows is None:
                self.rows = []
            self.rows.append(row)
        for values, value in zip(self.new, new):
            values.append(value)
        for values, value in zip(self.old, old):
            values.append(value)
        self.weights.append(weight)
        self.tenants.append(tenant)


    def drop(self, positions: Collection[int]) -> Write:
        """This write without its rows at ``positions`` (indexes into ``ids``)."""
        keep = [i for i in range(len(self.ids)) if i not in positions]
        return Write(self.columns, [self.ids[i] for i in keep], [[c[i] for i in keep] for c in self.new],
                     [[c[i] for i in keep] for c in self.old] if any(self.old) else [],
                     [self.weights[i] for i in keep], [self.tenants[i] for i in keep],
                     keep if self.rows is None else [self.rows[i] for i in keep])


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


class RowVersioned:
    """What row-counting schemes written by row version (``aesgcm``, ``vault-transit``) share: a row
    is written only where it is still the version read, each stale row counts once."""

    guard: ClassVar[WriteGuard] = "version"
    counts_values = False


class Scheme(Protocol):
    """One ciphertext scheme bound to one resolved target and the run's keyring."""

    name: ClassVar[str]
    guard: ClassVar[WriteGuard]
    counts_values: bool  # True: reports count values (fpc1, with stale_values: drain.counting); False: rows
    target: ResolvedTarget
    current_key: str

    def stale_condition(self, ops: Operations, alias: str | None = None) -> str:
        """SQL of the engine's pieces, without parameters: rows that may hold a value to move to
        the current key (a pre-filter: the plan decides each value)."""

    def read_list(self, ops: Operations, alias: str | None = None) -> list[str]:
        """What the drain reads per row after the id (the plan's ``row[1:]``), of the engine's pieces."""

    def plan(self, rows: Sequence[Sequence[Any]], known_failed: Collection[str] = ()) -> BatchPlan:
        """The writes for ``rows`` = ``(id, *read_list)``; every new value verified before it is returned."""

    def value_keys_sql(self, ops: Operations, alias: str) -> list[tuple[str, str]] | None:
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


class SchemeClass(Protocol):
    """What the registry holds for a format: the class, built bound to one target (validating the
    target's columns and the keyring then), and what the run asks of it before any target is read."""

    name: str
    guard: WriteGuard

    def __call__(self, target: ResolvedTarget, keyring: Keyring, keys: KeysSettings, provider: object, /) -> Scheme:
        """Bind to ``target``; ``TargetBlocked`` when its columns cannot hold this scheme's values."""

    def check_keyring(self, keyring: Keyring, keys: KeysSettings) -> None:
        """``ConfigError`` when this scheme cannot use the keyring (before any target is read)."""


# Optional protocols: what only some schemes do. The generic code asks with isinstance().

@runtime_checkable
class InventoryFacts(Protocol):
    """A bound scheme that adds facts to its target's inventory (vault-transit: its versions)."""

    def inventory_facts(self) -> dict[str, Any]:
        """Facts reported as they are."""

    def counted_facts(self, ops: Operations, alias: str) -> dict[str, str]:
        """Facts counted over the in-scope rows: name -> condition on a row (``alias``), in SQL of
        the engine's pieces."""


@runtime_checkable
class OrderedKeys(Protocol):
    """A scheme class whose keys are versions in order (the gate asks it by format name)."""

    def newer_than(self, key: str, current: str) -> bool:
        """Is ``key`` above ``current`` (its values are NEWER: a key rolled back)?"""

    def retired_with(self, key: str, facts: Mapping[str, Any]) -> Callable[[str], bool]:
        """Which keys destroying ``key`` retires (``facts``: the target's inventory facts)."""


@runtime_checkable
class LegacyMigration(Protocol):
    """A scheme class that also migrates unversioned legacy values (the keyring's legacy key is one of
    its keys) and refuses a writing run until the application writes the versioned form."""

    def check_start(self, keys: KeysSettings, keyring: Keyring, expected_key: str | None) -> None:
        """``RefusedToStart`` when a run that writes must not start."""


class IntegerVersions:
    """``OrderedKeys`` for integer key versions (``aesgcm``, ``vault-transit``): destroying a
    version retires that version only, unless a scheme says otherwise."""

    @staticmethod
    def check_keyring(keyring: Keyring, keys: KeysSettings) -> None:
        keyring.current_version  # noqa: B018 - raises ConfigError when current is not an integer version

    @staticmethod
    def newer_than(key: str, current: str) -> bool:
        return is_version(key) and is_version(current) and int(key) > int(current)

    @staticmethod
    def retired_with(key: str, facts: Mapping[str, Any]) -> Callable[[str], bool]:
        return lambda k: k == key
