"""The PostgreSQL room as a whole (``base.room.Room``): features, SQL pieces, the table catalog, the
gate's checks, the throttle's signals, the advisory lock and connections. Each part is typed with
its ``base`` protocol, and ``ROOM`` with ``Room``, so mypy proves it complete. (The drain's write
guards are still in ``drain/``: docs/engines.md, "Migration plan".)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa
from psycopg import sql

from ..base.catalog import Catalog
from ..base.checks import AdvisoryLock, GateChecks, ThrottleSignals
from ..base.features import Features
from ..base.operations import Operations
from ..base.room import Room
from . import connect, stream
from .catalog import CATALOG
from .connect import PgConnection
from .features import FEATURES
from .gate import GATE_CHECKS
from .operations import OPERATIONS
from .signals import ADVISORY_LOCK, THROTTLE_SIGNALS


class PostgresRoom:
    features: Features = FEATURES
    operations: Operations = OPERATIONS
    catalog: Catalog[PgConnection] = CATALOG
    gate: GateChecks[PgConnection] = GATE_CHECKS  # mypy proves here that the gate's checks are complete
    signals: ThrottleSignals[PgConnection] = THROTTLE_SIGNALS
    lock: AdvisoryLock[PgConnection] = ADVISORY_LOCK

    def make_engine(self, url: str, *, pool_size: int = 5) -> sa.Engine:
        return connect.make_engine(url, pool_size=pool_size)

    def raw_connection(self, engine: sa.Engine) -> AbstractContextManager[PgConnection]:
        return connect.raw_connection(engine)

    def describe_db_error(self, exc: BaseException | None) -> str:
        return connect.describe_db_error(exc)

    def stream(self, conn: PgConnection, query: sql.Composed, name: str,
               fetched: Callable[[int], None] | None = None) -> Iterator[Any]:
        """A large read's rows through a server-side cursor (``stream.stream``)."""
        return stream.stream(conn, query, name, fetched)


ROOM: Room[PgConnection] = PostgresRoom()  # mypy proves here that the room is complete
