"""What a command asks of the database engine, one method per step that differs by engine
(``EngineCommands``): the run's steps that ``rotation`` dispatches, and ``inventory``, ``discover``,
``gate --retire``, ``grants``, ``seed`` and its reach. A protocol only: ``postgresql.py`` and
``mysql/`` implement it, ``commands_for`` picks one per database URL.

Each method is the engine's own path, whole: the rules shared by both engines (what a step
refuses, records and reports) stay with the caller, in ``rotation`` and ``flows.cli``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa

from ..config import Settings, TargetSettings
from ..drain import DrainOptions, DrainResult, Shard
from ..gate.discover import Discovery
from ..gate.verdict import GateReport
from ..inventory import Inventory
from ..keyring import Keyring
from ..log import log_event
from ..providers import KeyProvider
from ..schemes.base import Scheme
from ..throttle import Throttle, ThrottleControlSource

if TYPE_CHECKING:  # the samples are imported by ``seed`` only
    from ..samples import forge_sample, pin_profile

# Re-reads rows a run committed and decrypts every value: (rows read, rows that decrypted).
VerifySample = Callable[[Scheme, Sequence[Any]], tuple[int, int]]


def count_read_back(scheme: Scheme, rows: Iterable[Sequence[Any]]) -> tuple[int, int]:
    """(rows read, rows whose every value decrypts under a key of the keyring): a run's verify of
    rows it committed (each row its id, then the scheme's ``read_list``), as ``inventory --deep``
    reads them. A row that does not is logged by its id (``verify_failed``), never by a value."""
    sampled = ok = 0
    for row in rows:
        sampled += 1
        if any(failed or value.category == "UNKNOWN_KEY" for value, failed in scheme.inspect(row[1:], True)):
            log_event("verify_failed", level=40, target=scheme.target.name, id=str(row[0]))
        else:
            ok += 1
    return sampled, ok


class RecordConflicts(Protocol):
    """Records one target's CONFLICT counts of a run (StateError when they cannot be)."""

    def __call__(self, target: str, by_tenant: Mapping[str, int], *, tenant_scope: str | None, complete: bool,
                 run_id: str) -> None: ...


class EngineCommands(Protocol):
    """One engine's paths through every step that differs by engine (Django's chosen backend)."""

    # -- a run's steps (``rotation``) --------------------------------------------------------------

    def make_throttle(self, engine: sa.Engine, settings: Settings, *, control: ThrottleControlSource | None,
                      run_id: str, writes: bool) -> Throttle:
        """The run's one throttle, reading this engine's load and replica signals (``writes``: not a
        dry run; on MySQL such a run also measures replica lag by a heartbeat it writes)."""

    def confirm_key_identity(self, engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider,
                             *, record: bool, run_id: str | None, quiet: bool) -> None:
        """Each key id is the key recorded for it (``record``: record the ids nothing was recorded for)."""

    def resolve_targets(self, engine: sa.Engine, settings: Settings, targets: Sequence[TargetSettings],
                        keyring: Keyring, provider: KeyProvider, *, tenant: str | None, dry_run: bool,
                        into: dict[str, Scheme]) -> None:
        """Resolve every target and bind its scheme into ``into`` before anything is written, and
        (not ``dry_run``, a ``cas`` target) create where the run records its CONFLICTs."""

    def drain(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions) -> DrainResult:
        """Drain one target, or one shard of it (``options.id_range``)."""

    def plan_shards(self, engine: sa.Engine, scheme: Scheme, options: DrainOptions, shards: int) -> list[Shard]:
        """A target's backlog as at most ``shards`` id ranges, each with its backlog."""

    def conflicts_recorder(self, engine: sa.Engine) -> AbstractContextManager[RecordConflicts]:
        """A connection to pinrotate's own records, as the function that records a target's CONFLICTs."""

    def verifier(self, engine: sa.Engine) -> AbstractContextManager[VerifySample]:
        """What re-reads a run's sample of committed rows (one connection for every target, or one each)."""

    def run_gate(self, engine: sa.Engine, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
                 targets: Sequence[TargetSettings], tenant: str | None, failed: Mapping[str, int],
                 conflicts: Mapping[str, int], run_id: str) -> dict[str, Any]:
        """A run's gate section: every older key decided as ``gate --retire`` decides it."""

    def advisory_lock(self, engine: sa.Engine, name: str) -> AbstractContextManager[bool]:
        """The room's advisory lock ``name`` held by one session; False if another holds it."""

    # -- the other commands (``flows.cli``, ``flows.seed_cli``) ------------------------------------

    def inventory(self, settings: Settings, *, deep: bool, tenant: str | None) -> Inventory:
        """``inventory``: read-only counts per target and key."""

    def discover(self, settings: Settings) -> Discovery:
        """``inventory --discover``: the gate's sweep for ciphertexts outside the configured targets."""

    def retire_gate(self, settings: Settings, key: str, *, tenant: str | None, deep: bool,
                    erase_excluded: bool) -> GateReport:
        """``gate --retire KEY``: may the key be destroyed now?"""

    def grant_statements(self, settings: Settings, role: str, *, read_only: bool) -> list[str]:
        """``grants``: the statements of the least-privilege role, as texts (nothing is run)."""

    def reach(self, settings: Settings) -> None:
        """``seed``, before a keyring file is created: is the server there (exit 4) and fit (exit 2)?"""

    def seed_pin_profile(self, settings: Settings, keyring: Keyring, *, rows: int,
                         key_id: str | None) -> pin_profile.SeedSummary:
        """``seed``: the Pin profile sample's tables and rows, encrypted under ``key_id``."""

    def seed_forge(self, settings: Settings, bootstrap_file: Path, *, rows: int) -> forge_sample.ForgeSeedSummary:
        """``seed --preset forge``: Forge's tables and values, and a sample Forge bootstrap file."""
