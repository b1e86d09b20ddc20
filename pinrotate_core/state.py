"""Facts of the last run that the database cannot show: the CONFLICT counts of ``fpc1`` targets.

One JSON file per database under ``$PINROTATE_HOME/state/``, named by a hash of the database's
address (user, host, port, database; never a password), changed under a file lock and replaced
atomically. It holds counts, target names and tenants only: never a value, key or URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg

from ._files import exclusive_lock, write_atomically
from .config import pinrotate_home
from .errors import PinrotateError

STATE_VERSION = 1
NO_TENANT = ""  # the tenant key of targets without a tenant column (and of rows whose tenant is NULL)


class StateError(PinrotateError):
    """The state folder or file cannot be read or written."""


def database_identity(conn: psycopg.Connection[Any]) -> str:
    """The address a connection reached, without password: ``user@host:port/dbname``.

    Taken from the live connection (not the configured URL) so that every spelling of one URL,
    and the CLI, the flow and the tests, land on the same state file.
    """
    info = conn.info
    return f"{info.user}@{info.host}:{info.port}/{info.dbname}"


def state_dir(home: Path | None = None) -> Path:
    return (pinrotate_home() if home is None else home) / "state"


def state_path(identity: str, home: Path | None = None) -> Path:
    digest = hashlib.sha256(identity.encode("utf-8")).hexdigest()[:32]
    return state_dir(home) / f"conflicts-{digest}.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        with exclusive_lock(path):
            yield
    except OSError as e:
        raise StateError(f"cannot lock the state file in {path.parent} ({e.strerror})") from None


def _read(path: Path) -> dict[str, dict[str, int]]:
    """``{target: {tenant: conflicts}}``; a missing file is an empty state."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        # Fail closed: an unreadable state must not read as "no conflicts".
        raise StateError(f"state file {path} cannot be read ({type(e).__name__}); it was left as it is") from None
    targets = raw.get("targets") if isinstance(raw, dict) else None
    if not isinstance(targets, dict):
        raise StateError(f"state file {path} is malformed; it was left as it is")
    out: dict[str, dict[str, int]] = {}
    for name, entry in targets.items():
        tenants = entry.get("conflicts") if isinstance(entry, dict) else None
        if not isinstance(tenants, dict) or not all(isinstance(n, int) for n in tenants.values()):
            raise StateError(f"state file {path} is malformed (target {name}); it was left as it is")
        out[str(name)] = {str(t): int(n) for t, n in tenants.items() if n > 0}
    return out


def _write(path: Path, state: Mapping[str, Mapping[str, int]], meta: Mapping[str, Mapping[str, Any]]) -> None:
    doc = {"version": STATE_VERSION,
           "targets": {name: {"conflicts": dict(sorted(tenants.items())), **meta.get(name, {})}
                       for name, tenants in sorted(state.items()) if tenants}}
    try:
        write_atomically(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    except OSError as e:
        raise StateError(f"cannot write the state file {path} ({e.strerror})") from None


def _read_meta(path: Path) -> dict[str, dict[str, Any]]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    targets = raw.get("targets", {}) if isinstance(raw, dict) else {}
    return {n: {k: v for k, v in e.items() if k != "conflicts"} for n, e in targets.items() if isinstance(e, dict)}


def record_conflicts(identity: str, target: str, by_tenant: Mapping[str, int], *, tenant_scope: str | None,
                     complete: bool, run_id: str = "", home: Path | None = None) -> None:
    """Store the CONFLICT counts of one non-dry run of ``target``.

    A complete run replaces what it covered: all tenants (``tenant_scope`` None) or its one tenant,
    so a later clean run clears earlier conflicts. A run that stopped early saw only part of the
    target: it adds what it found and clears nothing.
    """
    path = state_path(identity, home)
    with _locked(path):
        state = _read(path)
        meta = _read_meta(path)
        current = dict(state.get(target, {}))
        found = {t: n for t, n in by_tenant.items() if n > 0}
        if not complete:
            current.update(found)
        elif tenant_scope is None:
            current = found
        else:
            current.pop(tenant_scope, None)
            if found.get(tenant_scope):
                current[tenant_scope] = found[tenant_scope]
        if current == state.get(target, {}) and not found:
            return  # nothing to add or clear: leave the file alone
        state[target] = current
        meta[target] = {"run_id": run_id, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _write(path, state, meta)


def last_conflicts(identity: str, target: str, *, tenant: str | None = None, home: Path | None = None) -> int:
    """CONFLICT count of ``target`` left by the last runs: one tenant's, or every tenant's."""
    path = state_path(identity, home)
    if not path.exists():
        return 0
    with _locked(path):
        tenants = _read(path).get(target, {})
    if tenant is None:
        return sum(tenants.values())
    return tenants.get(tenant, 0)
