"""Sharing the database politely: adaptive batch size, replica-lag and load waits, pause from outside.

Called by a drain's reader thread before it begins (and locks) the next batch
(``Throttle.before_batch``), never while it holds that batch's rows: it only waits, or past a
``critical_*`` limit raises ``ThrottleCritical``. Its parts: ``sizer`` (the batch size),
``control`` (the operator's switch), the PostgreSQL room's ``signals`` (what it reads on the primary), ``replicas``
(replay lag), ``waiting`` (the throttle itself), ``mysql`` (the same throttle over MySQL / MariaDB's
``Threads_running`` and each replica's own lag). It never writes to the database and knows
nothing of the orchestrator (flows/throttle.py reads a Prefect Variable as its control source).
"""

from ..engines.postgresql.signals import APPLICATION_NAME, Signals, busy_sessions, read_signals, sessions_blocked_by_us
from .control import MAX_BATCH_SIZE, MAX_DELAY, OperatorControl, ThrottleControl, ThrottleControlSource, parse_control
from .replicas import ReplicaLagMeter, ReplicaPosition, parse_lsn
from .sizer import BatchSizer
from .waiting import (
    CHECK_INTERVAL,
    LOCKS_POLL_INTERVAL,
    MAX_WAIT_SLICE,
    POLL_INTERVAL,
    REASON_LAG,
    REASON_LOAD,
    REASON_LOCKS,
    REASON_PAUSED,
    REASONS,
    StopSignal,
    Throttle,
    ThrottleLimits,
    ThrottleState,
)

__all__ = [
    "APPLICATION_NAME", "CHECK_INTERVAL", "LOCKS_POLL_INTERVAL", "MAX_BATCH_SIZE", "MAX_DELAY", "MAX_WAIT_SLICE",
    "POLL_INTERVAL", "REASONS", "REASON_LAG", "REASON_LOAD", "REASON_LOCKS", "REASON_PAUSED", "BatchSizer",
    "OperatorControl", "ReplicaLagMeter", "ReplicaPosition", "Signals", "StopSignal", "Throttle", "ThrottleControl",
    "ThrottleControlSource", "ThrottleLimits", "ThrottleState", "busy_sessions", "parse_control", "parse_lsn",
    "read_signals", "sessions_blocked_by_us",
]
