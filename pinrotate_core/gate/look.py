"""One look of the gate: the inventory of every target and the sweep outside them, in ONE snapshot.

``gate --retire`` and the run's gate section both look through here, so they read the same moment the
same way (deep: every value decrypted; every candidate value outside the targets tried) and decide with
the same categories (contract §6). The xids in flight at the snapshot come back with the look: an open
verdict is settled only once they have ended (``settle``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa

from ..config import Settings
from ..engines.postgresql.snapshot import hold_target, one_moment
from ..errors import DatabaseError
from ..inventory import Inventory, inventory_on
from ..keyring import Keyring
from ..targets import ResolvedTarget
from .discover import Discovery, sweep_database


@dataclass
class Look:
    inventory: Inventory
    discovery: Discovery | None  # None: the inventory alone closes every key asked about
    in_progress: tuple[int, ...]  # xids in flight at the snapshot
    before: Any = None  # what ``first`` returned (the key identity check)


def _hold(conn: psycopg.Connection[Any], target: ResolvedTarget) -> str | None:
    return hold_target(conn, target.relation, target.settings.table)


def look_once(engine: sa.Engine, settings: Settings, keyring: Keyring, provider: object, *, deep: bool = True,
              key_ids: Sequence[str] | None, sweep_if: Callable[[Inventory], bool] = lambda inv: True,
              first: Callable[[psycopg.Connection[Any]], Any] | None = None) -> Look:
    """Read the whole database at one moment: ``first`` (key check values), the deep inventory of every
    configured target and tenant, then, when ``sweep_if(inventory)`` (a sweep can only close), the sweep
    outside the targets with ``key_ids``. A failure to read is a DatabaseError (the caller stays closed)."""
    with one_moment(engine) as moment:
        before = first(moment.conn) if first is not None else None
        inv = inventory_on(moment.conn, settings, keyring, deep=deep, provider=provider, hold=_hold)
        discovery = sweep_database(moment.conn, settings, keyring, key_ids) if sweep_if(inv) else None
        return Look(inv, discovery, moment.in_progress, before)


def not_swept(error: DatabaseError) -> Discovery:
    """What a failed sweep stands for: nothing searched, everything UNSWEPT (closed)."""
    out = Discovery(server_side=False)
    out.unswept["the database"] = f"the sweep outside the targets failed: {error}"
    return out
