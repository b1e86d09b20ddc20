"""One engine's room as a whole (Django's ``DatabaseWrapper``): what the drain, inventory, gate,
throttle and flows will ask of a database, whichever it is. A protocol only."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

import sqlalchemy as sa

from .catalog import Catalog
from .checks import AdvisoryLock, GateChecks, ThrottleSignals
from .features import Features
from .operations import Operations

Conn = TypeVar("Conn")


class Room(Protocol[Conn]):
    @property
    def features(self) -> Features: ...

    @property
    def operations(self) -> Operations: ...

    @property
    def catalog(self) -> Catalog[Conn]: ...

    @property
    def gate(self) -> GateChecks[Conn]: ...

    @property
    def signals(self) -> ThrottleSignals[Conn]: ...

    @property
    def lock(self) -> AdvisoryLock[Conn]: ...

    def make_engine(self, url: str, *, pool_size: int = 5) -> sa.Engine:
        """A pooled engine; connection failures become DatabaseUnavailable (one line, no password)."""

    def raw_connection(self, engine: sa.Engine) -> AbstractContextManager[Conn]:
        """A driver connection in autocommit, handed back to the pool clean."""

    def describe_db_error(self, exc: BaseException | None) -> str:
        """Class and error code only: a server message may quote values."""
