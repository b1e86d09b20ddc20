"""The batch drain: move every in-scope value of a target from older keys to the current key.

One pipeline for every scheme: keyset pagination by id (``id > last``) over the rows the scheme
calls stale and the scope rule admits, read without row locks, one short write transaction per
batch, the scheme's write guard (compare-and-swap on the row version read, or on the values read),
set-based writes, workers owning disjoint id ranges, sweeps for rows that someone else held locked
or changed, stop rules between batches, and a durability barrier before it reports. A provider failure rolls the
open batch back and stops the target; a value that does not decrypt is left unchanged and
reported. It never writes anything but the cipher columns (and the key-version column), and never
a row out of scope.

One drain for both engines: what differs (connections, transactions, the driver's errors, the
durability barrier, the guard, counts and plans) is asked of a ``port.DrainPort``: ``pg_port`` on
PostgreSQL, ``commands/mysql/drain_port.py`` on MySQL / MariaDB.

Its parts: ``run`` (one target's drain: workers, sweeps, barrier, result), ``pipeline`` (the batch
loop over its connections), ``port`` and ``pg_port`` (the engine's side), ``guards`` with ``guard_version`` and ``guard_cas`` (the write guards and
their statements), ``selection`` (the stale, in-scope rows as SQL), ``counting`` (backlog counts),
``shards`` (shard planning), ``options`` and ``results`` (what it is asked, what it reports),
``heap`` (gc freezing while drains run). It never imports rotation, the gate or the flows.
"""

from .heap import long_lived_heap_frozen
from .options import BeforeWrite, DrainOptions, stop_reason
from .pg_port import transaction_settings
from .results import (
    STOP_CANCELLED,
    STOP_DB_ERROR,
    STOP_DEADLINE,
    STOP_KEY_UNAVAILABLE,
    STOP_ORCHESTRATOR_LOST,
    STOP_THROTTLE_CRITICAL,
    BatchEvent,
    DrainResult,
    natural_id_order,
)
from .run import Drain, drain_target
from .shards import Shard, split_backlog

__all__ = [
    "STOP_CANCELLED", "STOP_DB_ERROR", "STOP_DEADLINE", "STOP_KEY_UNAVAILABLE", "STOP_ORCHESTRATOR_LOST", "STOP_THROTTLE_CRITICAL",
    "BatchEvent", "BeforeWrite", "Drain", "DrainOptions", "DrainResult", "Shard", "drain_target",
    "long_lived_heap_frozen", "natural_id_order", "split_backlog", "stop_reason", "transaction_settings",
]
