"""The ``vault-transit`` scheme: ``vault:v<N>:<base64>`` values as Vault / OpenBao Transit writes them.

Only the key version is read here; the payload stays opaque, because plaintext never leaves Vault:
re-encryption is Transit ``rewrap`` through the ``Rewrapper`` port (the vault-transit provider
implements it; this module never imports a provider). Stale: a key-version column below the
current version when the target has one, else the lowest ``vault:v<N>:`` version of the row.
Counts rows when draining, values in the inventory. Errors never echo a value.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from ..config import KeysSettings
from ..engines.base.operations import Operations
from ..errors import CiphertextInvalid, ConfigError, KeyUnavailable, TargetBlocked, TransitValuesInvalid
from ..keyring import Keyring, is_version
from ..targets import Column, ResolvedTarget
from .base import UNKNOWN_VALUE, BatchPlan, FailedRow, IntegerVersions, Rewrapper, RowVersioned, ValueClass, Write

PREFIX: Final = "vault:v"
# Version: a positive integer without leading zeros, as Transit writes it.
_TRANSIT = re.compile(r"vault:v([1-9][0-9]{0,9}):([A-Za-z0-9+/]+={0,2})")
# The same for PostgreSQL's regex engine: the whole value must be ``vault:v<N>:`` + padded
# standard base64 (what ``transit_version`` accepts); group 1 is N.
# Above any version Transit writes (at most 10 digits): the lowest version of a row without a Transit value.
NO_VERSION: Final = 99_999_999_999
TRANSIT_VALUE_PATTERN: Final = (
    r"^vault:v([1-9][0-9]{0,9}):(?:[A-Za-z0-9+/]{4})*"
    r"(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=|[A-Za-z0-9+/]{4})$"
)
# Column types a vault:v<N>: value can live in (text forms, or its ASCII bytes in bytea).
TRANSIT_COLUMN_TYPES: Final = frozenset({"text", "varchar", "bpchar", "bytea"})


def _as_text(value: str | bytes | memoryview) -> str | None:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("ascii")
    except UnicodeDecodeError:
        return None


def transit_version(value: str | bytes | memoryview) -> int:
    """The key version ``N`` of ``vault:v<N>:<base64>``; ``CiphertextInvalid`` when not in that form."""
    text = _as_text(value)
    match = _TRANSIT.fullmatch(text) if text is not None else None
    if match is None:
        raise CiphertextInvalid("value is not a vault-transit ciphertext (vault:v<N>:<base64>)")
    try:
        base64.b64decode(match.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise CiphertextInvalid("vault-transit ciphertext payload is not valid base64") from None
    return int(match.group(1))


def transit_version_or_none(value: str | bytes | memoryview | None) -> int | None:
    """For inventory: the version, or None when the value is NULL or not parseable (UNKNOWN)."""
    if value is None:
        return None
    try:
        return transit_version(value)
    except CiphertextInvalid:
        return None


def is_transit(value: str | bytes | memoryview | None) -> bool:
    return transit_version_or_none(value) is not None


def _column_text(stored: Any, column: Column) -> str | None:
    """The stored value as text (bytea holds ASCII); None when it cannot be a Transit value."""
    if isinstance(stored, str):
        return stored.rstrip(" ") if column.type_name == "bpchar" else stored
    return _as_text(stored)


def _stored_form(value: str, column: Column) -> str | bytes:
    return value.encode("ascii") if column.type_name == "bytea" else value


@dataclass(frozen=True)
class _Stale:
    """One value of a batch that goes to Transit: where it came from and what it is."""

    row: int  # index into the batch's rows that parsed
    column: int
    value: str


def plan_transit_batch(target: str, columns: Sequence[Column], rows: Sequence[Sequence[Any]], current: int,
                       rewrapper: Rewrapper, *, known_failed: Collection[str] = ()) -> BatchPlan:
    """New values for ``rows`` = ``(id, key_version or None, *cipher_columns)``, all on ``current``.

    Values older than ``current`` go to Transit in one rewrap; values already on ``current`` or
    newer are kept as they are, never downgraded. A row with a value that is not ``vault:v<N>:``,
    or that Transit refuses, is FAILED and left unchanged; the others are sent again without it.
    Provider errors (``KeyUnavailable``) propagate: the caller rolls the batch back.
    """
    write = Write(tuple(range(len(columns))))
    plan = BatchPlan(writes=[write])
    kept: list[tuple[Any, list[str | None], int]] = []  # (id, values, position in the rows given)
    stale: list[_Stale] = []
    todo = [(i, r) for i, r in enumerate(rows) if not known_failed or str(r[0]) not in known_failed]
    plan.skipped = len(rows) - len(todo)
    for position, row in todo:
        texts: list[str | None] = []
        behind: list[_Stale] = []
        bad: list[str] = []
        for j, (column, stored) in enumerate(zip(columns, row[2:])):
            text = None if stored is None else _column_text(stored, column)
            texts.append(text)
            if stored is None:
                continue
            version = transit_version_or_none(text)
            if version is None:
                bad.append(column.name)
            elif version < current:
                behind.append(_Stale(len(kept), j, text or ""))
        if bad:
            plan.failed.append(FailedRow(target, str(row[0]), tuple(bad)))
            continue
        kept.append((row[0], texts, position))
        stale += behind

    rewrapped, fresh, refused = _rewrap_isolating_refusals(columns, stale, rewrapper, target)
    for item, new_value in zip(rewrapped, _verified(target, fresh, len(rewrapped), current)):
        kept[item.row][1][item.column] = new_value

    for i, (row_id, texts, position) in enumerate(kept):
        if i in refused:
            plan.failed.append(FailedRow(target, str(row_id), tuple(refused[i])))
            continue
        write.add(row_id, [None if text is None else _stored_form(text, c) for c, text in zip(columns, texts)],
                  row=position)
    return plan


def _rewrap_isolating_refusals(columns: Sequence[Column], stale: Sequence[_Stale], rewrapper: Rewrapper,
                               target: str) -> tuple[list[_Stale], list[str], dict[int, list[str]]]:
    """Rewrap ``stale`` in one call; when Transit refuses some values, their rows drop out and the
    rest go again (a refusal is per value and does not change on a second try, so this ends)."""
    pending = list(stale)
    refused: dict[int, list[str]] = {}
    while pending:
        try:
            return pending, rewrapper.rewrap([s.value for s in pending]), refused
        except TransitValuesInvalid as e:
            positions = sorted({p for p in e.failed_positions if 0 <= p < len(pending)})
            if not positions:
                raise KeyUnavailable(f"target {target}: Transit refused values without saying which",
                                     retryable=False) from None
            for p in positions:
                refused.setdefault(pending[p].row, []).append(columns[pending[p].column].name)
            pending = [s for s in pending if s.row not in refused]
    return [], [], refused


def _verified(target: str, fresh: Sequence[str], expected: int, current: int) -> Sequence[str]:
    """Check what Transit returned before anything is written: one value per input, each on ``current``.

    Decrypting them back would bring plaintext into this process; the version and the count are
    what can be checked here (Transit itself authenticates every value it returns).
    """
    if len(fresh) != expected:
        raise KeyUnavailable(f"target {target}: rewrap returned {len(fresh)} values for {expected}", retryable=False)
    for value in fresh:
        try:
            version = transit_version(value)
        except CiphertextInvalid:
            raise KeyUnavailable(f"target {target}: rewrap returned a value that is not vault:v<N>:",
                                 retryable=False) from None
        if version != current:
            # The Transit key was rotated after this run read it: nothing is written under a
            # version the run did not start with; the next run works towards the new one.
            raise KeyUnavailable(
                f"target {target}: rewrap returned key version {version}, not the run's current version {current} "
                "(the Transit key was rotated during the run; the next run continues)", retryable=False)
    return fresh


def classify_transit_version(version: int, current: int, min_decryption_version: int) -> str:
    """ACTIVE on the latest version; HISTORICAL while Transit can still decrypt it; UNKNOWN_KEY below
    ``min_decryption_version``; NEWER above the latest version read at the start (a rotation since)."""
    if version == current:
        return "ACTIVE"
    if version > current:
        return "NEWER"
    return "HISTORICAL" if version >= min_decryption_version else "UNKNOWN_KEY"


def transit_version_sql(ops: Operations, column: Column, alias: str | None = None) -> str:
    """SQL for the key version a stored value of ``column`` names: NULL when the value is NULL or
    not the whole ``vault:v<N>:<base64>`` (``TRANSIT_VALUE_PATTERN``, exact bytes), as
    ``transit_version_or_none`` reads it."""
    text = ops.value_text(ops.column(column.name, alias), column.type_name)
    digits = ops.before_first(f"SUBSTRING({text} FROM {len(PREFIX) + 1})", ":")
    return (f"(CASE WHEN {ops.regex_match(text, TRANSIT_VALUE_PATTERN)}"
            f" THEN {ops.to_int(digits)} END)")


class TransitScheme(IntegerVersions, RowVersioned):
    """``vault-transit`` bound to one target, the run's keyring and the provider's rewrap port."""

    name: ClassVar[str] = "vault-transit"

    def __init__(self, target: ResolvedTarget, keyring: Keyring, keys: KeysSettings, rewrapper: object) -> None:
        if not isinstance(rewrapper, Rewrapper) or not keyring.server_side:
            raise ConfigError(f"target {target.name}: format vault-transit needs keys.provider = vault-transit")
        odd = [c.name for c in target.columns if c.type_name not in TRANSIT_COLUMN_TYPES]
        if odd:
            raise TargetBlocked(target.name, f"vault-transit cipher columns must be text, varchar or bytea "
                                             f"({', '.join(odd)} is not)")
        self.target = target
        self.keyring = keyring
        self.rewrapper = rewrapper
        self.current = keyring.current_version
        self.current_key = keyring.current
        self.oldest = keyring.min_decryption_version or 1

    @staticmethod
    def retired_with(key: str, facts: Mapping[str, Any]) -> Callable[[str], bool]:
        """Destroying version N retires every version <= N that Transit still decrypts (raising
        ``min_decryption_version`` past N retires them all; the ones below it are UNKNOWN_KEY already)."""
        if not is_version(key):
            return lambda k: k == key
        oldest = int(facts.get("transit_min_decryption_version") or 0)
        return lambda k: k == key or (is_version(k) and oldest <= int(k) < int(key))

    def lowest_version_sql(self, ops: Operations, alias: str | None = None) -> str:
        """The lowest key version among a row's values; ``NO_VERSION`` when none is a Transit value
        (one form for every engine: MySQL's LEAST is NULL as soon as one argument is)."""
        parts = [f"COALESCE({transit_version_sql(ops, c, alias)}, {NO_VERSION})" for c in self.target.columns]
        return parts[0] if len(parts) == 1 else f"LEAST({', '.join(parts)})"

    def stale_condition(self, ops: Operations, alias: str | None = None) -> str:
        kv = self.target.key_version
        lhs = ops.column(kv.name, alias) if kv is not None else self.lowest_version_sql(ops, alias)
        return f"{lhs} < {int(self.current)}"

    def read_list(self, ops: Operations, alias: str | None = None) -> list[str]:
        kv = self.target.key_version
        first = ops.column(kv.name, alias) if kv is not None else ops.to_int("NULL")
        return [first, *(ops.column(c.name, alias) for c in self.target.columns)]

    def key_version_column(self) -> Column | None:
        return self.target.key_version

    def plan(self, rows: Sequence[Sequence[Any]], known_failed: Collection[str] = ()) -> BatchPlan:
        return plan_transit_batch(self.target.name, self.target.columns, rows, self.current, self.rewrapper,
                                  known_failed=known_failed)

    def value_keys_sql(self, ops: Operations, alias: str) -> list[tuple[str, str]] | None:
        # Values, not rows: the prefix, not the key-version column, is what Transit decrypts with.
        return [(ops.text_of(transit_version_sql(ops, c, alias)), f"{ops.column(c.name, alias)} IS NOT NULL")
                for c in self.target.columns]

    def classify_key(self, key: str | None) -> ValueClass:
        if key is None:
            return UNKNOWN_VALUE
        return ValueClass(classify_transit_version(int(key), self.current, self.oldest), key)

    def inspect(self, row: Sequence[Any], deep: bool) -> Iterator[tuple[ValueClass, bool]]:
        # Deep reading changes nothing: checking that a value decrypts would ask Transit for its plaintext.
        for column, stored in zip(self.target.columns, row[1:]):
            if stored is not None:
                version = transit_version_or_none(_column_text(stored, column))
                yield self.classify_key(None if version is None else str(version)), False

    def growth(self, column: Column) -> int:
        # vault:v9: -> vault:v10: (any older version may be shorter than the current one).
        return len(str(self.current)) - 1

    def length_after(self, column: Column, stored: Any) -> int | None:
        text = _column_text(stored, column)
        version = transit_version_or_none(text)
        if text is None or version is None or version >= self.current:
            return None
        # Transit keeps the payload's length; only the version's digits change.
        return len(text) + len(str(self.current)) - len(str(version))

    def inventory_facts(self) -> dict[str, Any]:
        return {"transit_latest_version": self.current, "transit_min_decryption_version": self.oldest}

    def counted_facts(self, ops: Operations, alias: str) -> dict[str, str]:
        """Rows whose key-version column already says current while a value is older: the drain
        selects by that column and would not take them."""
        kv = self.target.key_version
        if kv is None:
            return {}
        current = int(self.current)
        behind = f"{ops.column(kv.name, alias)} >= {current} AND {self.lowest_version_sql(ops, alias)} < {current}"
        return {"transit_rows_behind_key_version": behind}
