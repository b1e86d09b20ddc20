"""What the gate and the throttle ask of an engine, as engine-neutral facts: transactions in
flight and prepared, durability, replica positions, load, the advisory lock. No SQL here; an
engine answers with these types, the caller decides what closes a gate or slows a drain."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

Conn_contra = TypeVar("Conn_contra", contravariant=True)


@dataclass(frozen=True)
class OpenTransaction:
    """A transaction in flight in another session (never its statement text)."""

    session: int  # pid / thread id
    transaction: str  # the server's id of it
    user: str | None
    state: str | None
    open_s: float

    def describe(self) -> str:
        return f"session {self.session} (user {self.user!r}, {self.state or 'state not visible'}, open {self.open_s:.0f}s)"


@dataclass(frozen=True)
class CandidateColumn:
    """A column of any readable table that can hold a ciphertext (text or binary)."""

    schema: str
    table: str
    column: str
    type_name: str
    binary: bool  # bytes (BLOB, VARBINARY, bytea) rather than text
    readable: bool  # the role may SELECT it; False: UNREADABLE unless vouched for
    transactional: bool = True  # inside the snapshot (False: MyISAM, Aria, MEMORY: UNSWEPT unless vouched for)

    @property
    def label(self) -> str:
        return f"{self.schema}.{self.table}.{self.column}"


@dataclass(frozen=True)
class Durability:
    """Whether a commit the gate saw survives a crash of the primary, and the settings that say so."""

    durable: bool
    settings: dict[str, Any]
    reasons: tuple[str, ...] = ()  # why not, in words


@dataclass(frozen=True)
class ReplicaPosition:
    """One replica as seen from itself or from the primary."""

    name: str
    lag_s: float | None  # None: not known (replication stopped, or not measurable)
    position: str | None  # GTID set / LSN it has applied
    running: bool
    problem: str | None = None


@dataclass(frozen=True)
class LoadSample:
    threads_running: int  # sessions busy in a statement now, the sampling session included
    facts: dict[str, Any] = field(default_factory=dict)


class GateChecks(Protocol[Conn_contra]):
    def snapshot(self, conn: Conn_contra) -> AbstractContextManager[None]:
        """One consistent, read-only snapshot for every read made inside it."""

    def candidate_columns(self, conn: Conn_contra) -> list[CandidateColumn]:
        """Every text or binary column of every table the server shows the role, system schemas aside."""

    def in_flight(self, conn: Conn_contra) -> list[OpenTransaction]:
        """Transactions open in other sessions now."""

    def prepared(self, conn: Conn_contra) -> list[str]:
        """Ids of prepared (two-phase / XA) transactions not yet committed or rolled back."""

    def durability(self, conn: Conn_contra) -> Durability: ...

    def primary_position(self, conn: Conn_contra) -> str | None:
        """Where the primary's log stands now (GTID set / LSN), for the replicas to reach."""

    def replica_positions(self, conn: Conn_contra) -> list[ReplicaPosition]:
        """The replication this server takes part in: MySQL reports it as the replica sees it (its
        own replica status, empty on a primary); PostgreSQL as the primary sees its physical standbys
        and slots (empty on a standby)."""


class ThrottleSignals(Protocol[Conn_contra]):
    def load(self, conn: Conn_contra) -> LoadSample: ...

    def replica_lag(self, conn: Conn_contra) -> list[ReplicaPosition]: ...


class AdvisoryLock(Protocol[Conn_contra]):
    def held(self, conn: Conn_contra, name: str) -> AbstractContextManager[bool]:
        """Try once, never wait: True while held, False when someone else holds it."""


