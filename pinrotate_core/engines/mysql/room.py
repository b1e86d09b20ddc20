"""The MySQL / MariaDB room as a whole (``base.room.Room``): its features and every piece."""

from __future__ import annotations

from contextlib import AbstractContextManager

import sqlalchemy as sa

from ..base.catalog import Catalog
from ..base.checks import AdvisoryLock, GateChecks, ThrottleSignals
from ..base.features import Features
from ..base.operations import Operations
from ..base.room import Room
from . import connect
from .catalog import CATALOG
from .connect import MySqlConnection
from .gate import GATE_CHECKS
from .operations import OPERATIONS
from .signals import ADVISORY_LOCK, THROTTLE_SIGNALS

FEATURES = Features(
    name="mysql",
    has_row_versions=False,  # no xmin: every scheme writes by compare-and-swap on the values read
    has_skip_locked=True,  # MySQL 8.0+, MariaDB 10.6+
    has_row_security=False,
    can_silence_triggers=False,  # no session_replication_role: triggers = "disable" is BLOCKED
    has_auto_updated_columns=True,  # ON UPDATE CURRENT_TIMESTAMP
    schema_is_database=True,
    prepared_per_database=False,  # XA RECOVER lists the whole server's
)


class MySqlRoom:
    features: Features = FEATURES
    operations: Operations = OPERATIONS
    catalog: Catalog[MySqlConnection] = CATALOG
    gate: GateChecks[MySqlConnection] = GATE_CHECKS
    signals: ThrottleSignals[MySqlConnection] = THROTTLE_SIGNALS
    lock: AdvisoryLock[MySqlConnection] = ADVISORY_LOCK

    def make_engine(self, url: str, *, pool_size: int = 5) -> sa.Engine:
        return connect.make_engine(url, pool_size=pool_size)

    def raw_connection(self, engine: sa.Engine) -> AbstractContextManager[MySqlConnection]:
        return connect.raw_connection(engine)

    def describe_db_error(self, exc: BaseException | None) -> str:
        return connect.describe_db_error(exc)


ROOM: Room[MySqlConnection] = MySqlRoom()  # mypy proves here that the room is complete
