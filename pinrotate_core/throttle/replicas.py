"""Replica lag in seconds: how long ago the primary had WAL that a replaying standby still lacks.

Standbys are the configured replica URLs (each on a connection of its own) or, when none are
configured, the replaying standbys the primary's ``pg_stat_replication`` shows (see engines/postgresql/signals.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from ..db import describe_db_error, redacted
from ..engines.postgresql.signals import APPLICATION_NAME, Signals, read_signals, replay_position

MAX_LAG_SAMPLES = 100_000  # (time, LSN) pairs kept while a replica is behind (~14 h at one per 0.5 s)
REPLICA_CONNECT_TIMEOUT = 5  # seconds


def parse_lsn(text: str) -> int:
    """A ``pg_lsn`` (``16/B374D848``) as an integer."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


@dataclass
class ReplicaPosition:
    name: str
    replayed: int | None  # None: unknown (unreachable, not a replica, or not visible to our role)
    problem: str | None = None


class ReplicaLagMeter:
    """Replay lag in seconds, measured as "how long ago did the primary have WAL the replica lacks".

    It remembers (time, ``pg_current_wal_lsn()``) samples of the primary; a replica's lag is now
    minus the time of the oldest sample beyond the position it has replayed, and 0 when it has
    replayed the latest one. So a replica whose replay stopped lags more and more while the primary
    writes, and an idle primary (a throttled drain writes nothing) shows no lag at all, which
    ``pg_stat_replication.replay_lag`` (kept at its last value) and ``now() -
    pg_last_xact_replay_timestamp()`` (grows while idle) both get wrong.
    """

    def __init__(self, replica_urls: Sequence[str] | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_urls = tuple(replica_urls) if replica_urls else ()
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque(maxlen=MAX_LAG_SAMPLES)
        self._conns: dict[str, psycopg.Connection[Any]] = {}
        self._problems: dict[str, str] = {}

    @property
    def discovers(self) -> bool:
        """Are the standbys found from the primary (no replica URLs configured)?"""
        return not self.replica_urls

    def measure(self, primary: psycopg.Connection[Any], signals: Signals | None = None) -> dict[str, float | None]:
        """Lag per replica (seconds; None when its position cannot be read) after one new sample.

        ``signals``: the primary's WAL position (and, when discovering, its standbys) as the
        throttle's look read them; None: read them here."""
        if signals is None:
            signals = read_signals(primary, wal=True, standbys=self.discovers)
        now = self._clock()
        current = parse_lsn(signals.wal_lsn) if signals.wal_lsn else 0
        if not self._samples or self._samples[-1][1] != current:
            self._samples.append((now, current))
        positions = self._discovered(signals.standbys or []) if self.discovers else self._configured()
        lags: dict[str, float | None] = {}
        for pos in positions:
            lags[pos.name] = None if pos.replayed is None else self._lag(pos.replayed, now)
        known = [p.replayed for p in positions if p.replayed is not None]
        if known and len(known) == len(positions):
            self._forget_through(min(known))
        return lags

    def problems(self) -> dict[str, str]:
        """Why the position of a replica could not be read, by replica, as of the last measure."""
        return dict(self._problems)

    def _lag(self, replayed: int, now: float) -> float:
        for when, lsn in self._samples:
            if lsn > replayed:
                return max(0.0, now - when)
        return 0.0

    def _forget_through(self, replayed: int) -> None:
        # Samples every replica has replayed can no longer define anyone's lag; keep the last one.
        while len(self._samples) > 1 and self._samples[0][1] <= replayed:
            self._samples.popleft()

    def _discovered(self, standbys: list[dict[str, Any]]) -> list[ReplicaPosition]:
        out = []
        problems: dict[str, str] = {}
        for standby in standbys:
            name, lsn = str(standby["name"]), standby["replay_lsn"]
            if lsn is None:
                # Fail-safe: a standby we cannot see the position of might be far behind.
                problems[name] = ("replay position hidden from this role (grant pg_monitor to it)"
                                  if not standby["visible"] else "has not reported a replay position yet")
            out.append(ReplicaPosition(name, None if lsn is None else parse_lsn(str(lsn)), problems.get(name)))
        self._problems = problems
        return out

    def _configured(self) -> list[ReplicaPosition]:
        out = []
        problems: dict[str, str] = {}
        for url in self.replica_urls:
            name = redacted(url)
            try:
                conn = self._conns.get(url)
                if conn is None or conn.closed:
                    # prepare_threshold=None: no server-side prepared statements (a pooler may sit between).
                    conn = psycopg.connect(url, autocommit=True, application_name=APPLICATION_NAME,
                                           connect_timeout=REPLICA_CONNECT_TIMEOUT, prepare_threshold=None)
                    self._conns[url] = conn
                replayed = replay_position(conn)
            except psycopg.Error as e:
                self._drop(url)
                problems[name] = f"unreachable ({describe_db_error(e)})"
                out.append(ReplicaPosition(name, None, problems[name]))
                continue
            if replayed is None:
                problems[name] = "not a streaming replica (pg_is_in_recovery() is false)"
                out.append(ReplicaPosition(name, None, problems[name]))
                continue
            out.append(ReplicaPosition(name, parse_lsn(replayed)))
        self._problems = problems
        return out

    def _drop(self, url: str) -> None:
        conn = self._conns.pop(url, None)
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def close(self) -> None:
        for url in list(self._conns):
            self._drop(url)
