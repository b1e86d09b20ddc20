"""The ``fpc1`` scheme: Forge's ``FPC1:<SM4|AES>:<keyId>:<payload>`` (ECB/PKCS#7, base64), its
headerless legacy values and its JSON fields.

Self-describing values: the key id lives in the value, so every value of a row is decided alone
and counted alone. Rows are read without locks and written with compare-and-swap on the value
read; a value the application changed meanwhile is a CONFLICT, never overwritten. A value moves to
the active key with its own algorithm (a legacy value with its column's ``legacy_algorithm``);
nothing is ever written in a legacy form. ECB has no integrity: a value whose padding or UTF-8
fails holds back every value of its key (``held``, filled by the drain's pre-pass
``drain.fpc1_precheck`` and by any batch that meets one), so that a wrong key never turns the odd
value that happens to unpad into garbage under the new key. No error message here contains a
value, a plaintext or a key.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any, ClassVar, Final

from .._primitives import PaddingInvalid
from ..config import KeysSettings
from ..engines.base.operations import Operations
from ..errors import CiphertextInvalid, ConfigError, KeyUnavailable, RefusedToStart, TargetBlocked, VerificationFailed
from ..keyring import Keyring
from ..targets import Column, ResolvedTarget
from ._json_paths import replace_json_values
from .base import (
    DECRYPT_FAILED,
    LEGACY_KEY,
    STALE,
    UNKNOWN_KEY,
    UNKNOWN_VALUE,
    BatchPlan,
    FailedRow,
    ValueClass,
    Write,
    WriteGuard,
)
from .fpc1_values import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    FPC1_OVERHEAD,
    JSON_REWRITE_REFUSED,
    MAX_PAYLOAD_GROWTH,
    PREFIX,
    Algorithm,
    Fpc1CipherSet,
    ValueField,
    check_algorithm,
    classify,
    classify_value,
    group_of,
    length_after,
    values_of_column,
)

# Why a value whose key is held back is left: another value of its key failed its padding or UTF-8.
KEY_HELD: Final = "key_held"

# Column types an FPC1 value is stored in: bytea cannot hold it as written, char(n) would pad it with blanks.
TEXT_TYPES: Final = frozenset({"text", "varchar", "json", "jsonb"})


class Fpc1Scheme:
    """``fpc1`` bound to one target and the run's keyring (see the module docstring).

    Per value, in scope: ACTIVE is skipped (a run can be repeated); HISTORICAL, and LEGACY when
    ``legacy_read_enabled``, are re-encrypted with their own algorithm; LEGACY with legacy reading
    off is counted (``legacy_left``) and left alone; UNKNOWN is counted and left alone; UNKNOWN_KEY
    (or legacy with no legacy key) is a failed row with reason ``unknown_key``; a value that does
    not decrypt one with ``decrypt_failed``; a value whose key is held back (``held``) is counted
    ``key_held`` and left alone. A JSON column is rewritten once, with every field of it that moves.
    """

    name: ClassVar[str] = "fpc1"
    guard: ClassVar[WriteGuard] = "cas"
    counts_values = True

    def __init__(self, target: ResolvedTarget, keyring: Keyring, keys: KeysSettings, provider: object = None) -> None:
        reason = self.check_columns(target)
        if reason is not None:
            raise TargetBlocked(target.name, reason)
        self.target = target
        self.keyring = keyring
        self.current_key = keyring.current
        self.legacy_read_enabled = keys.legacy_read_enabled
        self.legacy_algorithms = legacy_algorithms(target, keys)
        # Built now: a keyring fpc1 cannot use (bad key length or id) stops the start.
        self.ciphers = Fpc1CipherSet(keyring, legacy_read_enabled=self.legacy_read_enabled)
        self._deep_ciphers = Fpc1CipherSet(keyring, legacy_read_enabled=True)
        self._paths = {c.name: tuple(target.settings.json_paths.get(c.name, ())) for c in target.columns}
        self._active_prefixes = [f"{PREFIX}:{a}:{keyring.current}:" for a in ALGORITHMS]
        # Keys (key ids, or "legacy") no value of which this run rewrites: one of their values failed
        # its padding or UTF-8 (the pre-pass, or any batch since). Shared by the drain's workers.
        self.held: set[str] = set()
        self._held_lock = threading.Lock()

    @staticmethod
    def check_columns(target: ResolvedTarget) -> str | None:
        for c in target.columns:
            if c.type_name not in TEXT_TYPES:
                return f"cipher column {c.name} is {c.sql_type}; fpc1 needs text, varchar(n), json or jsonb"
            if c.type_name in ("json", "jsonb") and not target.settings.json_paths.get(c.name):
                return f"cipher column {c.name} is {c.sql_type}: name its encrypted fields in json_paths"
        return None

    @staticmethod
    def check_keyring(keyring: Keyring, keys: KeysSettings) -> None:
        # 16-byte keys with well-formed ids, or the start stops here rather than in a target's drain.
        Fpc1CipherSet(keyring)

    @staticmethod
    def check_start(keys: KeysSettings, keyring: Keyring, expected_key: str | None) -> None:
        """Forge's migration preconditions, for a run that writes: Forge uses its persistent keyring,
        every writer writes FPC1 already, and the run names the key it expects to be active."""
        policy = keyring.policy
        if policy is not None and not policy.enabled:
            raise RefusedToStart(f"{policy.enabled_setting} is false: Forge does not use its persistent keyring;"
                                 " refusing to migrate (a --dry-run is allowed)")
        if not keys.write_versioned:
            setting = policy.write_versioned_setting if policy is not None else "keys.write_versioned"
            raise RefusedToStart(f"{setting} is false: refusing to migrate until every writer writes FPC1"
                                 " (a --dry-run is allowed)")
        if expected_key is None:
            raise RefusedToStart("--expected-key-version is required for a non-dry run over fpc1 targets")

    def values(self, column: Column, text: str | None) -> list[tuple[ValueField, str | None]]:
        return values_of_column(column.name, self._paths[column.name], text)

    def classify(self, stored: str | None) -> ValueClass:
        return UNKNOWN_VALUE if stored is None else classify_value(stored, self.keyring)

    def rewrite(self, column: Column, stored: str) -> str:
        """``stored`` under the active key as Forge's ``reencrypt`` writes it, verified."""
        try:
            return self.ciphers.reencrypt_to_current(stored, self.legacy_algorithms[column.name])
        except VerificationFailed:
            raise KeyUnavailable(f"target {self.target.name}: a value re-encrypted under key "
                                 f"{self.keyring.current} did not verify", retryable=False) from None

    def failing_values(self, texts: Sequence[Any]) -> list[tuple[str, str]]:
        """(label, key) of each value of a row (its column texts) that fails its padding or UTF-8:
        what the drain's pre-pass (``drain.fpc1_precheck``) holds keys back for."""
        out: list[tuple[str, str]] = []
        for column, text in zip(self.target.columns, texts):
            for value_field, stored in self.values(column, text):
                key = None if stored is None else group_of(stored)
                if key is not None and stored is not None and not self.check_value(column, stored):
                    out.append((value_field.label, key))
        return out

    def check_value(self, column: Column, stored: str) -> bool:
        """Does ``stored`` decrypt under its key (padding and UTF-8)? Only a padding or UTF-8 failure
        is False; other failures (no such key, a misshapen payload) say nothing about the key, and a
        value this run would not read (legacy, with legacy reading off) is not tried."""
        try:
            self.ciphers.decrypt(stored, self.legacy_algorithms[column.name])
        except PaddingInvalid:
            return False
        except (CiphertextInvalid, KeyUnavailable):
            pass
        return True

    def hold(self, keys: Collection[str]) -> None:
        """Rewrite no value of ``keys`` from now on (see ``held``)."""
        with self._held_lock:
            self.held.update(keys)

    def is_held(self, key: str | None) -> bool:
        with self._held_lock:
            return key in self.held

    # -- Scheme --------------------------------------------------------------------------------

    def stale_condition(self, ops: Operations, alias: str | None = None) -> str:
        """A plain column not starting with an active prefix, or any JSON column (its fields are
        only known once parsed)."""
        conds: list[str] = []
        for column in self.target.columns:
            ref = ops.column(column.name, alias)
            if self._paths[column.name]:
                conds.append(f"{ref} IS NOT NULL")
                continue
            text = ops.text_of(ref)
            not_active = " AND ".join(f"NOT {ops.starts_with(text, p)}" for p in self._active_prefixes)
            # NULL and blank values are no ciphertexts (Forge leaves them alone): never selected.
            conds.append(f"({ref} IS NOT NULL AND TRIM({text}) <> '' AND {not_active})")
        return f"({' OR '.join(conds)})"

    def read_list(self, ops: Operations, alias: str | None = None) -> list[str]:
        t = self.target.settings
        tenant = ops.text_of(ops.column(t.tenant, alias) if t.tenant else "NULL")
        # json/jsonb are read as their text, which the JSON rewrite works on.
        return [tenant, *(ops.text_of(ops.column(c.name, alias)) for c in self.target.columns)]

    def plan(self, rows: Sequence[Sequence[Any]], known_failed: Collection[str] = ()) -> BatchPlan:
        """Decide every value of ``rows`` = ``(id, tenant, *column texts)``; each value alone: in a
        row with two stale fields one may move and the other fail. All or nothing per key: every
        value is decrypted before any is planned, and a padding or UTF-8 failure holds back its key
        for this batch and the rest of the run (``held``)."""
        target = self.target.name
        plan = BatchPlan()
        can_read_legacy = self.legacy_read_enabled and self.keyring.legacy is not None
        # (row index, column index, field, group, new value or None, failure reason or None)
        decided: list[tuple[int, int, ValueField, str | None, str | None, str | None]] = []
        failing: set[str] = set()
        for i, row in enumerate(rows):
            for j, (column, text) in enumerate(zip(self.target.columns, row[2:])):
                for value_field, stored in self.values(column, text):
                    value = self.classify(stored)
                    if value.category == "ACTIVE":
                        continue
                    if value.category == "UNKNOWN":
                        plan.count("unknown")
                        continue
                    assert stored is not None
                    if value.category == "LEGACY" and not self.legacy_read_enabled:
                        plan.count("legacy_left")
                        continue
                    if value.category == "UNKNOWN_KEY" or (value.category == "LEGACY" and not can_read_legacy):
                        plan.count("unknown_key")
                        decided.append((i, j, value_field, None, None, UNKNOWN_KEY))
                        continue
                    group = group_of(stored)
                    try:
                        decided.append((i, j, value_field, group, self.rewrite(column, stored), None))
                    except PaddingInvalid:
                        failing.add(str(group))
                        decided.append((i, j, value_field, group, None, DECRYPT_FAILED))
                    except CiphertextInvalid:
                        decided.append((i, j, value_field, group, None, DECRYPT_FAILED))
                    except KeyUnavailable:
                        plan.count("unknown_key")
                        decided.append((i, j, value_field, group, None, UNKNOWN_KEY))
        if failing:
            self.hold(failing)
        with self._held_lock:
            held = frozenset(self.held)
        replacements: dict[tuple[int, int], dict[str | None, str]] = {}
        problems: dict[int, dict[str, list[str]]] = {}
        for i, j, value_field, group, new, reason in decided:
            if reason is not None:
                problems.setdefault(i, {}).setdefault(reason, []).append(value_field.label)
            elif group in held:
                plan.count(KEY_HELD)
            else:
                assert new is not None
                replacements.setdefault((i, j), {})[value_field.path] = new
        writes = {j: Write((j,)) for j in range(len(self.target.columns))}
        for (i, j), moved in replacements.items():
            row_id, tenant, text = rows[i][0], rows[i][1], rows[i][2 + j]
            column = self.target.columns[j]
            assert text is not None
            if not self._paths[column.name]:
                new_text = moved[None]
            else:
                try:
                    new_text = replace_json_values(text, {p: v for p, v in moved.items() if p is not None})
                except (CiphertextInvalid, LookupError, ConfigError):
                    # e.g. a key on the path occurs twice: which copy the application reads is not ours to guess.
                    problems.setdefault(i, {}).setdefault(JSON_REWRITE_REFUSED, []).extend(
                        f"{column.name}[{p}]" for p in moved if p is not None)
                    continue
            writes[j].add(row_id, [new_text], [text], weight=len(moved), tenant="" if tenant is None else str(tenant))
        for i in sorted(problems):
            for reason, labels in problems[i].items():
                plan.failed.append(FailedRow(target, str(rows[i][0]), tuple(labels), reason))
        plan.writes = [w for w in writes.values() if w.ids]
        return plan

    def stale_values(self, row: Sequence[Any]) -> int:
        return sum(1 for column, text in zip(self.target.columns, row[1:])
                   for _, stored in self.values(column, text)
                   if stored is not None and self.classify(stored).category in STALE)

    def settled(self, column: Column, read: Any, now: Any) -> bool:
        """True when ``now`` is ``read`` moved by another run: every value on the active key with the
        same plaintext, nothing else in the document changed. An application's edit is not."""
        before = dict(self.values(column, read))
        after = dict(self.values(column, now))
        if not after or before.keys() != after.keys():
            return False
        ciphers = self._deep_ciphers
        algorithm = self.legacy_algorithms[column.name]
        for where, value in after.items():
            old = before[where]
            if value is None or old is None or self.classify(value).category != "ACTIVE":
                return False
            try:
                if value != old and ciphers.decrypt(value, algorithm) != ciphers.decrypt(old, algorithm):
                    return False
            except (CiphertextInvalid, KeyUnavailable):
                return False
        if self._paths[column.name]:
            try:
                restored = replace_json_values(str(now), {f.path: str(before[f]) for f in after if f.path is not None})
            except (CiphertextInvalid, LookupError, ConfigError):
                return False
            return bool(restored == read)
        return True

    def value_keys_sql(self, ops: Operations, alias: str) -> list[tuple[str, str]] | None:
        return None  # key ids live inside values (and JSON documents): counted value by value

    def classify_key(self, key: str | None) -> ValueClass:
        if key is None:
            return UNKNOWN_VALUE
        if key == LEGACY_KEY:
            return ValueClass("LEGACY", key)
        if key == self.keyring.current:
            return ValueClass("ACTIVE", key)
        return ValueClass("HISTORICAL" if key in self.keyring.keys else "UNKNOWN_KEY", key)

    def inspect(self, row: Sequence[Any], deep: bool) -> Iterator[tuple[ValueClass, bool]]:
        # Deep reading decrypts legacy values whenever the keyring has the legacy key, whatever
        # legacy_read_enabled says: counting is not migrating.
        ciphers = self._deep_ciphers if deep else None
        for column, text in zip(self.target.columns, row[1:]):
            for _, stored in self.values(column, text):
                value = self.classify(stored)
                failed = False
                if (ciphers is not None and stored is not None
                        and value.category in ("ACTIVE", "HISTORICAL", "LEGACY")
                        and not (value.category == "LEGACY" and self.keyring.legacy is None)):
                    try:
                        ciphers.decrypt(stored, self.legacy_algorithms[column.name])
                    except CiphertextInvalid:
                        failed = True
                    except KeyUnavailable:
                        pass  # cannot happen for the categories tried; UNKNOWN_KEY is counted already
                yield value, failed

    def growth(self, column: Column) -> int:
        return max(len(self._paths[column.name]), 1) * (FPC1_OVERHEAD + len(self.current_key) + MAX_PAYLOAD_GROWTH)

    def length_after(self, column: Column, stored: Any) -> int | None:
        """Length of a column value after migration (an upper bound for JSON documents)."""
        text = str(stored)
        growth = 0
        changed = False
        for _, value in self.values(column, text):
            if value is None:
                continue
            # The keyring is not needed to size a value: any key id but the active one is rewritten.
            found = classify(value)
            shape = (ValueClass("ACTIVE" if found.key_id == self.current_key else "HISTORICAL", found.key_id)
                     if found.kind == "fpc1" else
                     ValueClass("LEGACY", LEGACY_KEY) if found.kind == "legacy-candidate" else UNKNOWN_VALUE)
            after = length_after(value, shape, self.current_key)
            if after is not None and shape.category != "ACTIVE":
                growth += after - len(value)
                changed = True
        return len(text) + growth if changed else None


def legacy_algorithms(target: ResolvedTarget, keys: KeysSettings) -> dict[str, Algorithm]:
    """The algorithm of each column's legacy values: the column's own (``legacy_algorithm = {col =
    ...}``), else the target's, else ``[keys] legacy_algorithm`` (Forge's forge.crypto.algorithm
    when unset there), else SM4."""
    own = target.settings.legacy_algorithm
    default = keys.legacy_algorithm or DEFAULT_ALGORITHM
    out: dict[str, Algorithm] = {}
    for column in target.columns:
        code = own.get(column.name, default) if isinstance(own, dict) else (own or default)
        out[column.name] = check_algorithm(code, f"target {target.name}: legacy_algorithm")
    return out
