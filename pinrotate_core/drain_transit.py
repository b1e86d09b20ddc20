"""The drain of ``vault-transit`` targets: move ``vault:v<N>:`` values to the Transit key's latest version.

Transit ``rewrap`` re-encrypts a whole batch server-side, so no plaintext and no key ever reach
this process. Selection, locking, transactions, sweeps and stop rules are those of ``AesGcmDrain``.
It never writes anything but the cipher columns and the key-version column, never a value it did
not just check to be on the run's current version, and never logs a value.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import sqlalchemy as sa
from psycopg import sql

from .drain import AesGcmDrain, DrainOptions
from .errors import CiphertextInvalid, ConfigError, KeyUnavailable
from .formats.transit import transit_version, transit_version_or_none
from .inventory_transit import TRANSIT_COLUMN_TYPES, lowest_version_sql, scope_sql
from .keyring import Keyring
from .providers.vault import TransitValuesInvalid
from .reencrypt import BatchPlan, FailedRow
from .targets import Column, ResolvedTarget

if TYPE_CHECKING:
    from .providers import KeyProvider


@runtime_checkable
class TransitRewrap(Protocol):
    """What the drain needs of the ``vault-transit`` provider: a batch rewrap, order preserved.

    ``rewrap`` raises ``TransitValuesInvalid`` (positions of the values Transit refused) or
    ``KeyUnavailable`` (outage, sealed, 429, timeout, revoked token, versions below
    ``min_decryption_version``).
    """

    description: str

    def rewrap(self, values: Sequence[str]) -> list[str]: ...


@dataclass(frozen=True)
class _Stale:
    """One value of a batch that goes to Transit: where it came from and what it is."""

    row: int  # index into the batch's rows that parsed (``kept`` in plan_transit_batch)
    column: int
    value: str


def _as_text(stored: Any, column: Column) -> str | None:
    """The stored value as text (bytea holds ASCII); None when it cannot be a Transit value."""
    if isinstance(stored, str):
        return stored.rstrip(" ") if column.type_name == "bpchar" else stored
    try:
        return bytes(stored).decode("ascii")
    except UnicodeDecodeError:
        return None


def _stored_form(value: str, column: Column) -> str | bytes:
    return value.encode("ascii") if column.type_name == "bytea" else value


def plan_transit_batch(target: str, columns: Sequence[Column], rows: Sequence[Sequence[Any]], current: int,
                       rewrapper: TransitRewrap, *, known_failed: Collection[str] = ()) -> BatchPlan:
    """New values for ``rows`` = ``(id, key_version or None, *cipher_columns)``, all on ``current``.

    Values older than ``current`` go to Transit in one rewrap (the provider splits it only as far
    as the server's per-request limit needs); values already on ``current`` or newer are kept as
    they are, never downgraded. A row with a value that is not ``vault:v<N>:``, or that Transit
    refuses, is FAILED and left unchanged; the others are sent again without it. Provider errors
    (``KeyUnavailable``) propagate: the caller rolls the batch back.
    """
    plan = BatchPlan(new_values=[[] for _ in columns])
    kept: list[tuple[Any, list[str | None]]] = []
    stale: list[_Stale] = []
    # Rows that already failed in this run are not sent to Transit again (sweeps re-select them).
    todo = [r for r in rows if str(r[0]) not in known_failed] if known_failed else rows
    plan.skipped = len(rows) - len(todo)
    for row in todo:
        row_id = row[0]
        texts: list[str | None] = []
        behind: list[_Stale] = []
        bad: list[str] = []
        for j, (column, stored) in enumerate(zip(columns, row[2:])):
            text = None if stored is None else _as_text(stored, column)
            texts.append(text)
            if stored is None:
                continue
            version = transit_version_or_none(text)
            if version is None:
                bad.append(column.name)
            elif version < current:
                behind.append(_Stale(len(kept), j, text or ""))
        if bad:
            plan.failed.append(FailedRow(target, str(row_id), tuple(bad)))
            continue
        kept.append((row_id, texts))
        stale += behind

    rewrapped, fresh, refused = _rewrap_isolating_refusals(target, columns, stale, rewrapper)
    for item, new_value in zip(rewrapped, _verified(target, fresh, len(rewrapped), current)):
        kept[item.row][1][item.column] = new_value

    for i, (row_id, texts) in enumerate(kept):
        if i in refused:
            plan.failed.append(FailedRow(target, str(row_id), tuple(refused[i])))
            continue
        plan.ids.append(row_id)
        for values, column, text in zip(plan.new_values, columns, texts):
            values.append(None if text is None else _stored_form(text, column))
    return plan


def _rewrap_isolating_refusals(target: str, columns: Sequence[Column], stale: Sequence[_Stale],
                               rewrapper: TransitRewrap) -> tuple[list[_Stale], list[str], dict[int, list[str]]]:
    """Rewrap ``stale`` in one call; when Transit refuses some values, their rows drop out and the
    rest go again (a refusal is per value and does not change on a second try, so this ends).

    Returns the values that were rewrapped, their new forms (same order), and the refused rows
    with the names of their refused columns.
    """
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


class TransitDrain(AesGcmDrain):
    """Drain of one ``vault-transit`` target.

    With a key-version column: rows with ``key_version < current``, and the column is set to
    ``current`` on write (as for ``aesgcm``). Without one: rows whose lowest ``vault:v<N>:``
    version (over the cipher columns, read in SQL) is below ``current``. Every batch: lock, one
    Transit rewrap, one set-based UPDATE, COMMIT; a provider error rolls it back.
    """

    def __init__(self, engine: sa.Engine, target: ResolvedTarget, keyring: Keyring, options: DrainOptions,
                 provider: KeyProvider | TransitRewrap | None) -> None:
        if not isinstance(provider, TransitRewrap):
            raise ConfigError(f"target {target.name}: format vault-transit needs keys.provider = vault-transit")
        odd = [c.name for c in target.columns if c.type_name not in TRANSIT_COLUMN_TYPES]
        if odd:
            raise ConfigError(f"target {target.name}: vault-transit cipher columns must be text, varchar or bytea "
                              f"({', '.join(odd)} is not)")
        self.rewrapper = provider
        super().__init__(engine, target, keyring, options)

    def _selection(self) -> tuple[sql.Composable, sql.Composable]:
        t = self.target.settings
        if t.key_version:
            kv: sql.Composable = sql.Identifier(t.key_version)
            conds: list[sql.Composable] = [sql.SQL("{} < %s").format(kv)]
        else:
            # No key-version column: the shared SELECT reads NULL in its place.
            kv = sql.SQL("NULL::int8")
            conds = [sql.SQL("{} < %s").format(lowest_version_sql(self.target))]
        conds.append(scope_sql(self.target, self.options.tenant))  # require_not_null, soft delete, --tenant
        return kv, sql.SQL(" AND ").join(conds)

    def _update(self) -> sql.Composed:
        return super()._update() if self.target.settings.key_version else self._update_values_only()

    def _update_values_only(self) -> sql.Composed:
        """The UPDATE for a target without a key-version column.

        Same placeholders in the same order as ``AesGcmDrain._update`` (current, the arrays,
        current), so the inherited ``_write`` runs it: the first current only feeds a one-row
        subquery; the guard re-checks the selection on the locked row.
        """
        typed = [self.target.id_column, *self.target.columns]  # unnest arrays, sent binary
        aliases = [sql.Identifier("pinrotate_id")] + [sql.Identifier(f"c{i}") for i in range(len(self._cols))]
        return sql.SQL(
            "UPDATE {rel} AS t SET {sets} FROM (SELECT %s::int8) AS pinrotate_run(current_version), "
            "unnest({arrays}) AS u({aliases}) WHERE t.{id} = u.pinrotate_id AND {lowest} < %s"
        ).format(
            rel=self.target.relation,
            sets=sql.SQL(", ").join(sql.SQL("{} = u.{}").format(c, a) for c, a in zip(self._cols, aliases[1:])),
            arrays=sql.SQL(", ").join(sql.SQL("%b::{}[]").format(sql.SQL(c.sql_type)) for c in typed),
            aliases=sql.SQL(", ").join(aliases), id=self._id, lowest=lowest_version_sql(self.target, "t"),
        )

    def _plan_batch(self, rows: Sequence[Sequence[Any]]) -> BatchPlan:
        return plan_transit_batch(self.target.name, self.target.columns, rows, self.current, self.rewrapper,
                                  known_failed=self.tally.failed_ids())
