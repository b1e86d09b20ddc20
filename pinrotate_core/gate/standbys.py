"""Have the physical standbys flushed what the gate read? A failover to one that has not would put
the last batches (``synchronous_commit = off``) back on a destroyed key.

Standbys are the primary's physical walsenders (``pg_stat_replication.flush_lsn``), its physical
replication slots (``restart_lsn``: a standby that is down still has one), and the configured
``[database] replicas`` (``pg_last_wal_receive_lsn()`` on each). Logical walsenders, base backups
and ``pg_receivewal`` (a WAL archiver, not a server one fails over to) are not waited for. The
PostgreSQL room reads the positions (``engines/postgresql/replicas.py``); the waiting and the verdict
are here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psycopg

from ..engines.postgresql.replicas import ConfiguredReplicas, discovered_standbys
from .settle_result import SettleResult, named

POLL_S = 0.1


def settle_standbys(primary: psycopg.Connection[Any], replica_urls: Sequence[str] | None, target: str, *,
                    wait: float) -> SettleResult:
    """Wait (at most ``wait`` seconds) until every physical standby has flushed past ``target``.

    The primary's own standbys and slots are always checked; ``replica_urls`` adds standbys it
    cannot list (cascaded ones, another provider's replicas). A standby or slot behind after the
    wait, or one whose position cannot be read, closes the gate (STANDBY_BEHIND), named.
    """
    started = time.monotonic()
    configured = ConfiguredReplicas(replica_urls or ())
    try:
        while True:
            found, left_out = discovered_standbys(primary, target)
            positions = found + configured.positions(target)
            behind = [p for p in positions if not p.caught_up]
            facts: dict[str, Any] = {"target_lsn": target, "waited_s": round(time.monotonic() - started, 3),
                                     "flushed": [{"name": p.name, "flush_lsn": p.flushed_lsn}
                                                 for p in positions if p.caught_up]}
            if left_out:
                facts["not_standbys"] = left_out
            if not behind:
                return SettleResult(True, facts=facts)
            if any(p.final for p in behind) or time.monotonic() - started >= wait:
                facts["behind"] = [{"name": p.name, "flush_lsn": p.flushed_lsn, "problem": p.problem}
                                   for p in behind]
                reason = (f"{len(behind)} standby(s) not flushed past {target} after {wait:g}s: "
                          f"{named([p.describe(target) for p in behind])}")
                if all(p.final for p in behind):
                    reason = f"{len(behind)} standby(s) cannot be confirmed: {named([p.describe(target) for p in behind])}"
                return SettleResult.closed("STANDBY_BEHIND", len(behind), reason, facts)
            time.sleep(POLL_S)
    finally:
        configured.close()
