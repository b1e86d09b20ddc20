"""``run`` (and ``--dry-run``) on MySQL / MariaDB (contract §5), every scheme the room can write
by compare-and-swap (there is no ``xmin``): ``aesgcm``, ``fpc1`` and ``vault-transit`` (its
values rewrapped by Transit in the plan, outside the batch's transaction; a value the application
changed meanwhile is left for the next run, as on PostgreSQL).

The run is the Prefect flow's, as on PostgreSQL: ``rotation`` asks here for each step of it on a
MySQL / MariaDB URL (``resolve_targets``, ``.selection.plan_shards``, ``drain``, ``verify_sample``;
the gate is ``.gate.run_gate``), and these return the same types as the PostgreSQL steps.

The drain is the one of ``drain/`` (``drain.run.drain_target``), PostgreSQL's too, through MySQL's
port (``.drain_port``: connections, batch transactions, the compare-and-swap write guard, the
backlog count, ``fpc1``'s whole-target pre-pass, the CONFLICT record).

Bookkeeping (``.bookkeeping``, in the server's ``pinrotate`` database): before anything is
written, ``rotation.read_current_key`` compares each key's check value with the one recorded in
``pinrotate.key_checks`` (recorded where none is; a dry run only compares; other material under a
recorded key id is refused, exit 2) and ``rotation.resolve_all`` creates ``pinrotate.conflicts``
for a run with an ``fpc1`` target. After each ``fpc1`` drain its CONFLICTs are recorded there for
the gate (a shard adds its own and clears nothing; ``rotation.record_run_conflicts`` records the
run's total once every shard has ended); a failure to record is exit 4.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pymysql
import sqlalchemy as sa

from ...config import Settings, TargetSettings
from ...drain.options import DrainOptions
from ...drain.results import DrainResult
from ...drain.run import drain_target
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql.connect import MySqlConnection
from ...engines.mysql.operations import OPERATIONS as ops
from ...errors import ConfigError, DatabaseError, TargetBlocked
from ...keyring import Keyring
from ...schemes.base import Scheme
from ...schemes.registry import build_scheme
from ..base import count_read_back
from .drain_port import MYSQL_PORT
from .inventory import capacity_blocker
from .selection import ALIAS
from .targets import resolve_mysql_target

WRITABLE = ("aesgcm", "fpc1", "vault-transit")
SAMPLE_IDS = 64  # rows a drain keeps for verify to read back


def resolve_targets(conn: MySqlConnection, settings: Settings, targets: Sequence[TargetSettings], keyring: Keyring,
                    provider: object, *, tenant: str | None) -> dict[str, Scheme]:
    """Every target resolved and its scheme bound before anything is written: one blocked target
    stops the start (exit 2, nothing touched)."""
    schemes: dict[str, Scheme] = {}
    try:
        for t in targets:
            if t.format not in WRITABLE:
                raise TargetBlocked(t.name, f"format {t.format} cannot run on MySQL / MariaDB yet (issue 32)")
            resolved = resolve_mysql_target(conn, t, writing=True)
            scheme = build_scheme(resolved, keyring, settings.keys, provider)
            reason = capacity_blocker(conn, scheme, tenant)
            if reason is not None:
                raise TargetBlocked(t.name, reason)
            schemes[t.name] = scheme
    except TargetBlocked as e:
        raise ConfigError(f"{e}; nothing was touched") from None
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"cannot resolve the targets ({mysql_connect.describe_db_error(e)})") from None
    return schemes


def drain(engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> DrainResult:
    """Drain one target, or one shard of it (``options.id_range``): the one drain of ``drain/``
    (backlog, pre-pass, batches, sweeps, backlog left, CONFLICTs recorded, the same log lines as on
    PostgreSQL) through MySQL's port (``.drain_port``)."""
    return drain_target(engine, scheme, options, MYSQL_PORT)


def verify_sample(engine: sa.Engine, scheme: Scheme, ids: Sequence[Any]) -> tuple[int, int]:
    """Re-read rows this run committed and decrypt every value (as ``inventory --deep`` does)."""
    t = scheme.target.settings
    idcol = ops.column(t.id, ALIAS)
    statement = (f"SELECT {idcol}, {', '.join(scheme.read_list(ops, ALIAS))} FROM {ops.relation(t.schema_name, t.table_name, ALIAS)}"
                 f" WHERE {idcol} IN ({', '.join(['%s'] * len(ids))})")
    try:
        with mysql_connect.raw_connection(engine) as conn, conn.cursor() as cur:
            cur.execute(statement, tuple(ids))
            rows = list(cur.fetchall())
    except pymysql.err.MySQLError as e:
        raise DatabaseError(f"target {t.name}: cannot read the rows to verify "
                            f"({mysql_connect.describe_db_error(e)})") from None
    return count_read_back(scheme, rows)
