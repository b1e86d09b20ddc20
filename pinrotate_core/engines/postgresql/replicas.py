"""The physical standbys of a PostgreSQL primary and how far each has flushed its WAL: the primary's
walsenders (``pg_stat_replication.flush_lsn``), its physical replication slots (``restart_lsn``: a
standby that is down still has one), and the configured ``[database] replicas``
(``pg_last_wal_receive_lsn()`` on each). Logical walsenders, base backups and ``pg_receivewal`` (a
WAL archiver, not a server one fails over to) are told apart and left out. Whether to wait, and
what closes the gate, stays with the gate (``gate/standbys.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from ...errors import DatabaseError
from ..base.features import redacted
from .connect import describe_db_error

REPLICA_CONNECT_TIMEOUT = 5  # seconds
MONITOR_PRIVILEGE = "pg_monitor (or pg_read_all_stats)"
# pg_receivewal reports no replay position; with that, its default name marks it as an archiver.
WAL_ARCHIVERS = frozenset({"pg_receivewal"})


@dataclass(frozen=True)
class StandbyPosition:
    name: str
    flushed_lsn: str | None
    caught_up: bool
    problem: str | None = None  # why its position is not known
    final: bool = False  # waiting cannot help (a missing privilege, not a standby)

    def describe(self, target: str) -> str:
        if self.problem:
            return f"{self.name}: {self.problem}"
        return f"{self.name} has flushed WAL to {self.flushed_lsn or 'nothing yet'}, not past {target}"


_WALSENDERS_SQL = """
SELECT r.pid, coalesce(nullif(r.application_name, ''), 'walreceiver'), coalesce(host(r.client_addr), 'local'),
       r.state, r.flush_lsn::text, coalesce(r.flush_lsn >= %(target)s::pg_lsn, false), r.replay_lsn IS NULL,
       -- A logical walsender is connected to a database and streams from a logical slot.
       a.datid IS NOT NULL OR EXISTS (SELECT 1 FROM pg_replication_slots s
                                       WHERE s.active_pid = r.pid AND s.slot_type = 'logical')
  FROM pg_stat_replication r LEFT JOIN pg_stat_activity a ON a.pid = r.pid
 ORDER BY r.pid
"""


_SLOTS_SQL = """
SELECT slot_name, restart_lsn::text, restart_lsn >= %(target)s::pg_lsn, active_pid
  FROM pg_replication_slots
 WHERE slot_type = 'physical' AND NOT temporary
 ORDER BY slot_name
"""


def discovered_standbys(primary: psycopg.Connection[Any], target: str) -> tuple[list[StandbyPosition], list[str]]:
    """The primary's physical standbys and slots, and what was left out (logical, backups, archivers)."""
    try:
        senders = primary.execute(_WALSENDERS_SQL, {"target": target}).fetchall()
        slots = primary.execute(_SLOTS_SQL, {"target": target}).fetchall()
    except psycopg.Error as e:
        raise DatabaseError(f"cannot read the standbys' positions ({describe_db_error(e)})") from None
    positions: list[StandbyPosition] = []
    left_out: list[str] = []
    not_standbys: set[int] = set()
    for pid, app, addr, state, flush_lsn, caught_up, no_replay, logical in senders:
        name = f"standby {app!r} (client_addr {addr}, pid {pid})"
        if state is None:
            positions.append(StandbyPosition(name, None, False, "its position is not visible to this role;"
                                              f" grant {MONITOR_PRIVILEGE}", final=True))
        elif logical or state == "backup" or (app in WAL_ARCHIVERS and no_replay):
            not_standbys.add(int(pid))
            kind = "logical walsender" if logical else "base backup" if state == "backup" else "WAL archiver"
            left_out.append(f"{kind} {app!r} (pid {pid})")
        else:
            positions.append(StandbyPosition(name, flush_lsn, bool(caught_up)))
    for slot, restart_lsn, caught_up, active_pid in slots:
        if active_pid is not None and int(active_pid) in not_standbys:
            continue
        if restart_lsn is None:
            left_out.append(f"physical slot {slot!r} (never used: reserves no WAL)")
            continue
        positions.append(StandbyPosition(f"physical slot {slot!r}", restart_lsn, bool(caught_up)))
    return positions, left_out


class ConfiguredReplicas:
    """Connections to the ``[database] replicas`` URLs, kept open while the gate waits."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = tuple(urls)
        self._conns: dict[str, psycopg.Connection[Any]] = {}

    def positions(self, target: str) -> list[StandbyPosition]:
        return [self._position(url, target) for url in self.urls]

    def _position(self, url: str, target: str) -> StandbyPosition:
        name = f"replica {redacted(url)}"
        try:
            conn = self._conns.get(url)
            if conn is None or conn.closed:
                # prepare_threshold=None: no server-side prepared statements (a pooler may sit between).
                conn = psycopg.connect(url, autocommit=True, application_name="pinrotate",
                                       connect_timeout=REPLICA_CONNECT_TIMEOUT, prepare_threshold=None)
                self._conns[url] = conn
            # Received and synced to disk by streaming; replayed (from an archive, too) is on disk as well.
            row = conn.execute("SELECT pg_is_in_recovery(),"
                               " greatest(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::text,"
                               " coalesce(greatest(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())"
                               " >= %s::pg_lsn, false)", (target,)).fetchone()
        except psycopg.Error as e:
            self._drop(url)
            return StandbyPosition(name, None, False, f"unreachable ({describe_db_error(e)})")
        if not row or not row[0]:
            return StandbyPosition(name, None, False, "not a standby (pg_is_in_recovery() is false)", final=True)
        return StandbyPosition(name, row[1], bool(row[2]))

    def _drop(self, url: str) -> None:
        conn = self._conns.pop(url, None)
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def close(self) -> None:
        for url in list(self._conns):
            self._drop(url)
