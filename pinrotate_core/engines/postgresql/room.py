"""The PostgreSQL room as a whole, as far as it has moved in (docs/engines.md, "Migration plan"):
features, SQL pieces, the table catalog, the gate's checks and connections. Each part is typed with
its ``base`` protocol, so mypy proves it complete. ``signals`` (``throttle/``) and ``lock``
(``rotation.py``) are not here yet: until they move in, this is no ``base.room.Room``, and
no caller may take it for one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa
from psycopg import sql

from ..base.catalog import Catalog
from ..base.checks import GateChecks
from ..base.features import Features
from ..base.operations import Operations
from . import connect, stream
from .catalog import CATALOG
from .connect import PgConnection
from .features import FEATURES
from .gate import GATE_CHECKS
from .operations import OPERATIONS


class PostgresRoom:
    features: Features = FEATURES
    operations: Operations = OPERATIONS
    catalog: Catalog[PgConnection] = CATALOG
    gate: GateChecks[PgConnection] = GATE_CHECKS  # mypy proves here that the gate's checks are complete

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


ROOM = PostgresRoom()
