"""Key identity: one key id is one key, on every host, run, worker and gate.

pinrotate keeps a non-secret check value per key id in ``pinrotate.key_checks``; a keyring whose key
of the same id gives another value is refused (exit 2) before anything is written or answered.
Never stored, logged or shown: a key, or anything from which one could be guessed.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Protocol, runtime_checkable

import psycopg
import sqlalchemy as sa
from psycopg import errors as pg_errors

from ._primitives import key_check_value
from .config import Settings
from .db import describe_db_error, raw_connection
from .engines.postgresql import bookkeeping as pg
from .errors import DatabaseError, KeyUnavailable, RefusedToStart
from .keyring import Keyring, sort_key
from .log import log_event
from .providers import KeyProvider, keyring_style

SCHEMA: Final = pg.SCHEMA
TABLE: Final = pg.KEY_CHECKS
QUALIFIED: Final = f"{SCHEMA}.{TABLE}"
HMAC_ALGORITHM: Final = "hmac-sha256-128:v1"  # _primitives.key_check_value
TRANSIT_ALGORITHM: Final = "transit-creation-time:v1"  # the version's creation time, as Transit reports it
STOP_KEY_MISMATCH: Final = "key_mismatch"  # a shard whose host holds other material under a key id (exit 2)

# The whole DDL (docs/reference.md, "The pinrotate.key_checks table"): the room's, printed ahead
# by grants.py.
CREATE_SQL: Final = pg.CREATE_TABLES[TABLE]


class KeyIdentityMismatch(RefusedToStart):
    """This keyring holds other material under a key id than the one recorded (exit 2)."""


@runtime_checkable
class TransitKeySource(Protocol):
    """A provider that keeps its key in Vault Transit: the key's metadata, never its material."""

    mount: str
    key_name: str

    def key_info(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class KeyCheck:
    """What is recorded for one key id. ``keyring`` keeps apart keyrings whose ids may coincide
    (an aesgcm keyring's version 1 and a Transit key's version 1)."""

    keyring: str
    key_id: str
    check_value: str = field(repr=False)
    algorithm: str


@dataclass
class KeyIdentity:
    """Which key ids were compared with a recorded check value, and which had none recorded."""

    compared: dict[str, tuple[datetime, str]] = field(default_factory=dict)  # key id -> (recorded_at, by)
    not_recorded: list[str] = field(default_factory=list)
    recorded_now: list[str] = field(default_factory=list)

    def about(self, key_id: str) -> dict[str, Any]:
        """What a gate report says of one key (when and by whom its check value was recorded; never the value)."""
        if key_id in self.compared:
            at, by = self.compared[key_id]
            return {"recorded": True, "recorded_at": at.isoformat(timespec="seconds"), "recorded_by": by,
                    "table": QUALIFIED}
        return {"recorded": False, "table": QUALIFIED,
                "note": f"no check value was recorded for key {key_id}: nothing could confirm it is the key "
                        "the runs wrote with"}


def key_checks_for(settings: Settings, keyring: Keyring, provider: KeyProvider) -> list[KeyCheck]:
    """The check value of every key the keyring holds (the legacy key included)."""
    if keyring.server_side:
        return _transit_checks(keyring, provider)
    scope = keyring_style(settings)
    keys = [keyring.keys[k] for k in keyring.ids()] + ([keyring.legacy] if keyring.legacy is not None else [])
    return [KeyCheck(scope, key.key_id, key_check_value(key.material), HMAC_ALGORITHM) for key in keys]


def _transit_checks(keyring: Keyring, provider: KeyProvider) -> list[KeyCheck]:
    """Transit keys never leave Vault: a version is identified by the creation time Transit keeps for
    it, so a key deleted and created again under the same name (new versions, same numbers) differs."""
    if not isinstance(provider, TransitKeySource):
        return []
    versions = provider.key_info().get("keys")
    if not isinstance(versions, dict):
        # Fail closed: a key whose versions cannot be told apart is not assumed to be the recorded one.
        raise KeyUnavailable(f"vault-transit {provider.mount}/{provider.key_name}: Transit lists no key versions, so "
                             "pinrotate cannot check that they are the ones recorded", retryable=False)
    scope = f"vault-transit {provider.mount}/{provider.key_name}"
    oldest = keyring.min_decryption_version or 1
    checks = []
    for version, info in versions.items():
        created = info.get("creation_time") if isinstance(info, dict) else info  # asymmetric keys: a map
        if str(version).isdigit() and int(version) >= oldest and created not in (None, ""):
            checks.append(KeyCheck(scope, str(version), str(created), TRANSIT_ALGORITHM))
    return sorted(checks, key=lambda c: sort_key(c.key_id))


def confirm_key_identity(engine: sa.Engine | None, settings: Settings, keyring: Keyring, provider: KeyProvider, *,
                         record: bool, run_id: str | None = None,
                         on: psycopg.Connection[Any] | None = None, quiet: bool = False) -> KeyIdentity:
    """Compare every key of ``keyring`` with the check value recorded for its id; ``record``: first
    record the ids nothing was recorded for (a non-dry run; a dry run and a gate only compare).

    ``KeyIdentityMismatch`` (exit 2) names the first id that differs; a role that may not create,
    write or read the table is refused with the privilege to grant. Nothing is written on a refusal.
    ``on``: read on that connection (the gate: inside its one snapshot) instead of one of ``engine``'s.
    ``quiet``: the check before a run exists (the CLI's, repeated by the run): what it finds is logged
    at DEBUG, so that a refusal after it is still the one line on stderr.
    """
    checks = key_checks_for(settings, keyring, provider)
    if not checks:
        return KeyIdentity()
    by = f"host {socket.gethostname()}" + (f" run {run_id}" if run_id else "")
    connection = contextlib.nullcontext(on) if on is not None else raw_connection(_engine(engine))
    with connection as conn:
        role = conn.info.user or "?"
        try:
            if not record and not pg.table_exists(conn, TABLE):
                return KeyIdentity(not_recorded=[c.key_id for c in checks])
            if record:
                _ensure_table(conn, role)
            with pg.transaction(conn, durable=record):
                mine: set[str] = set()
                if record:
                    # Insert where nothing is recorded, then compare: of two first runs at once, the
                    # second waits for the first one's row, then compares with it.
                    mine = pg.insert_key_checks(conn, checks[0].keyring, by,
                                                [(c.key_id, c.check_value, c.algorithm) for c in checks])
                recorded = pg.read_key_checks(conn, checks[0].keyring, [c.key_id for c in checks])
                identity = compare_recorded(checks, recorded, by)
                identity.recorded_now = [c.key_id for c in checks if c.key_id in mine]
        except KeyIdentityMismatch:
            raise
        except pg_errors.InsufficientPrivilege:
            grant = "SELECT, INSERT" if record else "SELECT"
            raise RefusedToStart(f"role {role} may not {'write' if record else 'read'} {QUALIFIED}, where pinrotate "
                                 f"checks that each key id is one key: GRANT {grant} ON {QUALIFIED} TO {role} (and "
                                 f"USAGE ON SCHEMA {SCHEMA}); nothing was written") from None
        except pg_errors.ReadOnlySqlTransaction:
            raise RefusedToStart(f"the database connection is read-only: a run cannot record its keys' check values "
                                 f"in {QUALIFIED}; nothing was written") from None
        except psycopg.Error as e:
            raise DatabaseError(f"cannot check the keys against {QUALIFIED} ({describe_db_error(e)})") from None
    news = bool(identity.recorded_now or identity.not_recorded)
    log_event("key_checks", level=logging.INFO if news and not quiet else logging.DEBUG, run_id=run_id,
              keyring=checks[0].keyring, compared=len(identity.compared), recorded=identity.recorded_now or None,
              not_recorded=identity.not_recorded or None)
    return identity


def _engine(engine: sa.Engine | None) -> sa.Engine:
    if engine is None:
        raise ValueError("confirm_key_identity needs an engine or a connection")
    return engine


def compare_recorded(checks: Sequence[KeyCheck], recorded: Mapping[str, Sequence[Any]], by: str) -> KeyIdentity:
    """``checks`` against what is recorded (key id -> (check value, algorithm, recorded_at, recorded_by)),
    on any engine: ``KeyIdentityMismatch`` (exit 2) for the first id whose value or algorithm differs."""
    identity = KeyIdentity()
    for check in checks:
        row = recorded.get(check.key_id)
        if row is None:
            identity.not_recorded.append(check.key_id)
            continue
        value, algorithm, at, recorded_by = row
        when = f"on {at.isoformat(timespec='seconds')} by {recorded_by}"
        if algorithm != check.algorithm:
            raise KeyIdentityMismatch(
                f"key {check.key_id}: the check value recorded in {QUALIFIED} {when} uses algorithm {algorithm}, "
                f"this pinrotate computes {check.algorithm}; cannot tell whether it is the same key, refusing "
                "before writing anything")
        if value != check.check_value:
            raise KeyIdentityMismatch(
                f"key {check.key_id} of this keyring ({by}) differs from the key {check.key_id} recorded in "
                f"{QUALIFIED} {when}: two keyrings disagree; refusing before writing anything")
        identity.compared[check.key_id] = (at, recorded_by)
    return identity


def _ensure_table(conn: psycopg.Connection[Any], role: str) -> None:
    """Create the table unless it exists (serialised across hosts by an advisory lock); refused with
    the privilege to grant when the role may not."""
    try:
        pg.create_once(conn, TABLE, QUALIFIED)
    except pg_errors.InsufficientPrivilege:
        raise RefusedToStart(
            f"role {role} may not create {QUALIFIED}, where pinrotate records a check value per key id: GRANT "
            f"CREATE ON DATABASE {conn.info.dbname} TO {role} (or CREATE ON SCHEMA {SCHEMA} if it exists), or "
            "create it ahead (docs/reference.md, \"The pinrotate.key_checks table\"); nothing was written") from None
