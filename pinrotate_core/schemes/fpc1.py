"""The ``fpc1`` scheme: ``FPC1:<algorithm>:<keyId>:<base64(nonce||ct||tag)>``, its read-only legacy
forms and its JSON fields.

Self-describing values: the key id lives in the value, so every value of a row is decided alone
and counted alone. Rows are read without locks and written with compare-and-swap on the value
read; a value the application changed meanwhile is a CONFLICT, never overwritten. Legacy values
(``aesgcm-b64``: nonce || ct || tag; ``aes-ecb-b64``: AES-ECB/PKCS#7, authenticated by nothing
but its padding and, with ``legacy_plaintext = "utf8"``, its plaintext being UTF-8) are read and
rewritten as FPC1 ``AES-GCM``; nothing is ever written in a legacy form. No error message here
contains a value, a plaintext or a key.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Any, ClassVar, Final

from psycopg import sql

from ..config import KeysSettings
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
    FPC1_OVERHEAD,
    JSON_REWRITE_REFUSED,
    MAX_PAYLOAD_GROWTH,
    PREFIX,
    Algorithm,
    Fpc1CipherSet,
    LegacyFormat,
    LegacyPlaintext,
    ValueField,
    check_legacy_format,
    classify,
    classify_value,
    length_after,
    parse_fpc1,
    values_of_column,
)

# Column types an FPC1 value is stored in: bytea cannot hold it as written, char(n) would pad it with blanks.
TEXT_TYPES: Final = frozenset({"text", "varchar", "json", "jsonb"})


class Fpc1Scheme:
    """``fpc1`` bound to one target and the run's keyring (see the module docstring).

    Per value, in scope: ACTIVE is skipped (a run can be repeated); HISTORICAL, and LEGACY when
    ``legacy_read_enabled``, are re-encrypted (an FPC1 value keeps its algorithm, a legacy value
    becomes ``AES-GCM``); LEGACY with legacy reading off is counted (``legacy_left``) and left
    alone; UNKNOWN is counted and left alone; UNKNOWN_KEY (or legacy with no legacy key) is a
    failed row with reason ``unknown_key``; a value that does not decrypt one with
    ``decrypt_failed``. A JSON column is rewritten once, with every field of it that moves.
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
        self.legacy_format: LegacyFormat = check_legacy_format(keys.legacy_format)
        self.legacy_read_enabled = keys.legacy_read_enabled
        self.legacy_plaintext: LegacyPlaintext = keys.legacy_plaintext
        # Built now: a keyring fpc1 cannot use (bad key length or id) stops the start.
        self._ciphers: dict[Algorithm, Fpc1CipherSet] = {"AES-GCM": self._cipher_set("AES-GCM")}
        self._paths = {c.name: tuple(target.settings.json_paths.get(c.name, ())) for c in target.columns}
        self._active_prefixes = [f"{PREFIX}:{a}:{keyring.current}:" for a in ALGORITHMS]
        self._deep_ciphers: Fpc1CipherSet | None = None

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
        Fpc1CipherSet(keyring, legacy_format=keys.legacy_format)

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

    def _cipher_set(self, algorithm: Algorithm, *, legacy_read_enabled: bool | None = None) -> Fpc1CipherSet:
        enabled = self.legacy_read_enabled if legacy_read_enabled is None else legacy_read_enabled
        return Fpc1CipherSet(self.keyring, algorithm=algorithm, legacy_format=self.legacy_format,
                             legacy_read_enabled=enabled, legacy_plaintext=self.legacy_plaintext)

    def _ref(self, name: str, alias: str | None) -> sql.Identifier:
        return sql.Identifier(alias, name) if alias else sql.Identifier(name)

    def values(self, column: Column, text: str | None) -> list[tuple[ValueField, str | None]]:
        return values_of_column(column.name, self._paths[column.name], text)

    def classify(self, stored: str | None) -> ValueClass:
        return UNKNOWN_VALUE if stored is None else classify_value(stored, self.keyring, self.legacy_format)

    def rewrite(self, stored: str, value: ValueClass) -> str:
        """``stored`` under the active key, verified; FPC1 keeps its algorithm, legacy becomes AES-GCM."""
        algorithm: Algorithm = parse_fpc1(stored).algorithm if value.category != "LEGACY" else "AES-GCM"
        ciphers = self._ciphers.get(algorithm)
        if ciphers is None:
            try:
                ciphers = self._ciphers[algorithm] = self._cipher_set(algorithm)
            except ConfigError as e:  # e.g. an OpenSSL without SM4
                raise KeyUnavailable(f"target {self.target.name}: {e}", retryable=False) from None
        try:
            return ciphers.reencrypt_to_current(stored)
        except VerificationFailed:
            raise KeyUnavailable(f"target {self.target.name}: a value re-encrypted under key "
                                 f"{self.keyring.current} did not verify", retryable=False) from None

    # -- Scheme --------------------------------------------------------------------------------

    def stale_condition(self, alias: str | None = None) -> sql.Composable:
        """A plain column not starting with an active prefix, or any JSON column (its fields are
        only known once parsed)."""
        conds: list[sql.Composable] = []
        for column in self.target.columns:
            ref = self._ref(column.name, alias)
            if self._paths[column.name]:
                conds.append(sql.SQL("{} IS NOT NULL").format(ref))
                continue
            not_active = [sql.SQL("NOT starts_with({}::text, {})").format(ref, sql.Literal(p))
                          for p in self._active_prefixes]
            conds.append(sql.SQL("({} IS NOT NULL AND {})").format(ref, sql.SQL(" AND ").join(not_active)))
        return sql.SQL("({})").format(sql.SQL(" OR ").join(conds))

    def read_list(self, alias: str | None = None) -> list[sql.Composable]:
        t = self.target.settings
        tenant: sql.Composable = sql.SQL("{}::text").format(self._ref(t.tenant, alias)) if t.tenant else sql.SQL("NULL::text")
        # json/jsonb are read as their text, which the JSON rewrite works on.
        return [tenant, *(sql.SQL("{}::text").format(self._ref(c.name, alias)) for c in self.target.columns)]

    def plan(self, rows: Sequence[Sequence[Any]], known_failed: Collection[str] = ()) -> BatchPlan:
        """Decide every value of ``rows`` = ``(id, tenant, *column texts)``; each value alone: in a
        row with two stale fields one may move and the other fail."""
        target = self.target.name
        plan = BatchPlan()
        writes = {j: Write((j,)) for j in range(len(self.target.columns))}
        can_read_legacy = self.legacy_read_enabled and self.keyring.legacy is not None
        for row in rows:
            row_id, tenant = row[0], row[1]
            problems: dict[str, list[str]] = {}
            for j, (column, text) in enumerate(zip(self.target.columns, row[2:])):
                replacements: dict[str | None, str] = {}
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
                        problems.setdefault(UNKNOWN_KEY, []).append(value_field.label)
                        continue
                    try:
                        replacements[value_field.path] = self.rewrite(stored, value)
                    except CiphertextInvalid:
                        problems.setdefault(DECRYPT_FAILED, []).append(value_field.label)
                    except KeyUnavailable:
                        plan.count("unknown_key")
                        problems.setdefault(UNKNOWN_KEY, []).append(value_field.label)
                if not replacements:
                    continue
                assert text is not None
                if not self._paths[column.name]:
                    new_text = replacements[None]
                else:
                    try:
                        new_text = replace_json_values(text, {p: v for p, v in replacements.items() if p is not None})
                    except (CiphertextInvalid, LookupError, ConfigError):
                        # e.g. a key on the path occurs twice: which copy the application reads is not ours to guess.
                        problems.setdefault(JSON_REWRITE_REFUSED, []).extend(
                            f"{column.name}[{p}]" for p in replacements if p is not None)
                        continue
                writes[j].add(row_id, [new_text], [text], weight=len(replacements),
                              tenant="" if tenant is None else str(tenant))
            for reason, labels in problems.items():
                plan.failed.append(FailedRow(target, str(row_id), tuple(labels), reason))
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
        ciphers = self._deep_ciphers = self._deep_ciphers or self._cipher_set("AES-GCM", legacy_read_enabled=True)
        for where, value in after.items():
            old = before[where]
            if value is None or old is None or self.classify(value).category != "ACTIVE":
                return False
            try:
                if value != old and ciphers.decrypt(value) != ciphers.decrypt(old):
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

    def value_keys_sql(self, alias: str) -> list[tuple[sql.Composable, sql.Composable]] | None:
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
        ciphers = None
        if deep:
            ciphers = self._deep_ciphers = self._deep_ciphers or self._cipher_set("AES-GCM", legacy_read_enabled=True)
        for column, text in zip(self.target.columns, row[1:]):
            for _, stored in self.values(column, text):
                value = self.classify(stored)
                failed = False
                if (ciphers is not None and stored is not None
                        and value.category in ("ACTIVE", "HISTORICAL", "LEGACY")
                        and not (value.category == "LEGACY" and self.keyring.legacy is None)):
                    try:
                        ciphers.decrypt(stored)
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
            found = classify(value, legacy_format=self.legacy_format)
            shape = (ValueClass("ACTIVE" if found.key_id == self.current_key else "HISTORICAL", found.key_id)
                     if found.kind == "fpc1" else
                     ValueClass("LEGACY", LEGACY_KEY) if found.kind == "legacy-candidate" else UNKNOWN_VALUE)
            after = length_after(value, shape, self.current_key, self.legacy_format)
            if after is not None and shape.category != "ACTIVE":
                growth += after - len(value)
                changed = True
        return len(text) + growth if changed else None
