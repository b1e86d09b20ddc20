"""The read-only pre-pass of a drain over a scheme without integrity (``fpc1``: ECB, no tag).

Such a value under a wrong key is caught only by its padding and UTF-8, which a random block
passes about once in 256 tries. So before the drain's first batch, every stale value of the whole
target (every tenant, every shard's ids) is decrypted once, and a key (key id, or ``legacy``) any
value of which fails those checks is held back: the drain rewrites no value of it, the failing
values are FAILED and listed (those in this drain's id range), and the target ends with exit 4.
Other keys' values go on. A value written since under a key that passed here is caught by the
batch that meets it (the scheme's ``plan`` holds the key from then on). Reads only; never writes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import psycopg
from psycopg import sql

from ..engines.base.operations import Operations
from ..engines.postgresql.operations import OPERATIONS as PG
from ..engines.postgresql.operations import composable
from ..log import log_event
from ..schemes.base import DECRYPT_FAILED, FailedRow
from ..scope import scope_condition
from ..targets import ResolvedTarget
from .results import Tally
from .selection import Selection

SCAN_ROWS = 5000


@runtime_checkable
class HoldsFailingKeys(Protocol):
    """What a scheme without integrity offers the pre-pass (``fpc1``)."""

    target: ResolvedTarget

    def stale_condition(self, ops: Operations, alias: str | None = None) -> str: ...

    def read_list(self, ops: Operations, alias: str | None = None) -> list[str]: ...

    def failing_values(self, texts: Sequence[Any]) -> list[tuple[str, str]]:
        """(label, key) of each value of a row (the texts of ``read_list`` after the tenant) that
        fails its padding or UTF-8 under its key."""

    def hold(self, keys: Collection[str]) -> None:
        """Rewrite no value of ``keys`` in this run."""


def hold_failing_keys(conn: psycopg.Connection[Any], scheme: HoldsFailingKeys, selection: Selection,
                      id_range: tuple[Any, Any], tally: Tally, run_id: str = "") -> set[str]:
    """Decrypt every stale value of the target; hold back each key one of whose values fails, and
    record the failing rows of ``id_range`` in ``tally``. Returns the keys held."""
    target = scheme.target
    conds, params = selection.range(*id_range)
    in_range: sql.Composable = sql.SQL(" AND ").join(conds) if conds else sql.SQL("true")
    query = sql.SQL("SELECT {id}::text, ({in_range}), {cols} FROM {rel} WHERE {stale} AND {scope}").format(
        id=selection.id, in_range=in_range, cols=sql.SQL(", ").join(map(composable, scheme.read_list(PG))),
        rel=target.relation, stale=composable(scheme.stale_condition(PG)), scope=scope_condition(target.settings, None))
    with conn.transaction(), conn.cursor(name="pinrotate_fpc1_precheck") as cur:
        cur.itersize = SCAN_ROWS
        cur.execute(query, params)
        return hold_keys_failing_in(cur, scheme, tally, run_id)


def hold_keys_failing_in(rows: Iterable[Sequence[Any]], scheme: HoldsFailingKeys, tally: Tally,
                         run_id: str = "") -> set[str]:
    """The rule over the stale rows of the whole target, each ``(id, in the drain's id range,
    tenant, *values)`` as either engine reads them: hold back each key one of whose values fails,
    record the failing rows of the drain's range in ``tally``. Returns the keys held."""
    name = scheme.target.name
    failing: dict[str, int] = {}
    failed: list[FailedRow] = []
    for row in rows:
        found = scheme.failing_values(row[3:])
        for _, key in found:
            failing[key] = failing.get(key, 0) + 1
        if found and row[1]:
            failed.append(FailedRow(name, str(row[0]), tuple(label for label, _ in found), DECRYPT_FAILED))
    if failing:
        scheme.hold(failing)
        with tally.lock:
            for f in failed:
                tally.failed.setdefault((f.id, f.reason), f)
        for key, n in sorted(failing.items()):
            log_event("key_held", level=30, run_id=run_id or None, target=name, key=key, failing_values=n)
    return set(failing)
