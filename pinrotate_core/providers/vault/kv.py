"""``vault-kv``: the keyring in a KV v2 secret, read once per run, changed by check-and-set writes."""

from __future__ import annotations

import base64
import secrets
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import hvac.exceptions
from tenacity import Retrying, retry_if_result, stop_after_attempt, wait_random

from ...config import VaultSettings
from ...errors import ConfigError, ConflictError, KeyUnavailable
from ...keyring import Key, Keyring, check_key_ids, next_version, shown_key_id, shown_name, validate_key_id
from ...log import log_event
from .._material import decode_key, normalise_current
from .session import Response, VaultSession

_RESERVED_FIELDS = frozenset({"current", "legacy"})
# KV check-and-set attempts before a ConflictError (see _until_written).
_CAS_ATTEMPTS = 5
_T = TypeVar("_T")


class VaultKvKeyProvider:
    """The keyring from a KV v2 secret: fields ``current``, ``1``, ``2``, ... (base64), ``legacy``.

    The secret is read once per provider instance and cached: one read per run, never per row.
    ``add_key`` writes a new field without moving ``current``; ``promote`` moves it in a second
    write. Both use KV check-and-set, so a concurrent writer's change is never lost.
    """

    def __init__(self, settings: VaultSettings, *, style: str = "versions", session: VaultSession | None = None) -> None:
        if style not in ("versions", "named"):
            raise ValueError(f"unknown keyring style {style}")
        if not settings.path or not settings.path.strip("/"):
            raise ConfigError("keys.vault.path: required for provider \"vault-kv\"")
        self.mount = settings.mount.strip("/")
        self.path = settings.path.strip("/")
        if not self.mount:
            raise ConfigError("keys.vault.mount: must name the KV v2 mount")
        self.style = style
        self.description = f"vault-kv {self.mount}/{self.path}"
        self.session = session if session is not None else VaultSession(settings)
        self.reads = 0  # secret reads from Vault; load_keyring adds at most one per instance
        self._keyring: Keyring | None = None
        self._load_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"VaultKvKeyProvider({self.description!r}, addr={self.session.addr!r})"

    # -- reading -------------------------------------------------------------------------------

    def load_keyring(self) -> Keyring:
        with self._load_lock:
            return self._keyring if self._keyring is not None else self._load()

    def _load(self) -> Keyring:
        data, _version = self._read_secret()
        ring = self._parse(data)
        self._keyring = ring
        log_event("keyring_loaded", source=self.description, current=ring.current, keys=len(ring.keys))
        return ring

    def _read_secret(self) -> tuple[dict[str, Any], int]:
        response = self.session.call(
            f"read {self.description}",
            lambda c: c.secrets.kv.v2.read_secret_version(
                path=self.path, mount_point=self.mount, raise_on_deleted_version=True
            ),
            not_found=f"no secret at {self.mount}/{self.path} (absent, or its latest version deleted)",
        )
        self.reads += 1
        return self._secret_fields(response)

    def _secret_fields(self, response: Any) -> tuple[dict[str, Any], int]:
        try:
            data = response["data"]["data"]
            version = int(response["data"]["metadata"]["version"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"{self.description}: not a KV version 2 secret (is {self.mount} a KV v2 mount?)"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{self.description}: secret data is not a map of fields")
        return data, version

    def _parse(self, data: dict[str, Any]) -> Keyring:
        where = self.description
        if "current" not in data:
            raise ConfigError(f"{where}: field current is missing")
        raw_current = data["current"]
        if isinstance(raw_current, bool) or not isinstance(raw_current, (str, int)):
            raise ConfigError(
                f"{where}: field current must be a key version or key id string, not {type(raw_current).__name__}"
            )
        current = normalise_current(raw_current, where=f"{where}: field current")
        keys: dict[str, Key] = {}
        legacy: Key | None = None
        for position, (field_name, value) in enumerate(data.items(), start=1):
            if field_name == "current":
                continue
            if field_name == "legacy":
                legacy = decode_key("legacy", value, where=f"{where}: field legacy")
                continue
            # A field name is shown only when it is a key id that cannot be key material itself.
            validate_key_id(field_name, where=f"{where}: field {shown_name(field_name)!r} (field {position} of the"
                                               " secret; expected current, legacy and <key id> = <base64 key>)")
            keys[field_name] = decode_key(field_name, value, where=f"{where}: field {shown_key_id(field_name)}")
        check_key_ids(current, keys, where=where, name=lambda k: f"field {k}")
        if current not in keys:
            # A key version the keyring names but does not hold: fail closed (exit 4), never guess.
            raise KeyUnavailable(
                f"{where}: field current names key {shown_key_id(current)}, but field {shown_key_id(current)} is"
                " missing", retryable=False
            )
        return Keyring(current=current, keys=keys, legacy=legacy, source=where)

    # -- changing ------------------------------------------------------------------------------

    def add_key(self, key_id: str | None = None) -> str:
        """Write a fresh random key as a new field; ``current`` does not move until ``promote``.

        On an absent secret the first key is written with ``current`` naming it (nothing can
        have been encrypted under a keyring that did not exist).
        """
        if key_id is not None:
            validate_key_id(key_id, where="keys add")
            if key_id in _RESERVED_FIELDS:
                raise ConfigError(f"keys add: {key_id} is a reserved field name, not a key id")

        def attempt() -> str | None:
            data, version = self._read_for_update()
            if data:
                self._parse(data)  # never extend a keyring that does not load
            new_id = key_id if key_id is not None else self._next_key_id(data)
            if new_id in data:
                raise ConfigError(f"keys add: key {new_id} already exists in {self.description}")
            fields = dict(data)
            fields[new_id] = base64.b64encode(secrets.token_bytes(self._key_length())).decode("ascii")
            if not data:
                fields["current"] = new_id
            if not self._write(fields, cas=version, what=f"add key {new_id} to {self.description}"):
                return None
            self._keyring = None
            log_event("key_added", source=self.description, key=new_id, current=str(fields["current"]))
            return new_id

        return _until_written(attempt, f"keys add: {self.description} changed concurrently {_CAS_ATTEMPTS} times; "
                                       "nothing was added, try again")

    def promote(self, key_id: str) -> None:
        """Make ``key_id`` current (a second write after ``add_key``, so every reader has it first)."""

        def attempt() -> bool | None:
            data, version = self._read_for_update()
            if not data:
                raise ConfigError(f"keys promote: there is no keyring at {self.description}; add a key first")
            ring = self._parse(data)
            if key_id in _RESERVED_FIELDS or key_id not in ring.keys:
                raise ConfigError(f"keys promote: key {key_id} is not in {self.description}; add it first")
            if ring.current == key_id:
                return True
            fields = dict(data)
            fields["current"] = key_id
            if not self._write(fields, cas=version, what=f"promote key {key_id} in {self.description}"):
                return None
            self._keyring = None
            log_event("key_promoted", source=self.description, key=key_id, previous=ring.current)
            return True

        _until_written(attempt, f"keys promote: {self.description} changed concurrently {_CAS_ATTEMPTS} times; "
                                "nothing changed, try again")

    def _read_for_update(self) -> tuple[dict[str, Any], int]:
        """Fields and KV version for a check-and-set write; ``({}, 0)`` when the secret never existed."""
        absent: Response = {}
        response = self.session.call(
            f"read {self.description}",
            lambda c: c.secrets.kv.v2.read_secret_version(
                path=self.path, mount_point=self.mount, raise_on_deleted_version=True
            ),
            recover=lambda e: absent if isinstance(e, hvac.exceptions.InvalidPath) else None,
        )
        self.reads += 1
        if response is not absent:
            return self._secret_fields(response)
        metadata = self.session.call(
            f"read metadata of {self.description}",
            lambda c: c.secrets.kv.v2.read_secret_metadata(path=self.path, mount_point=self.mount),
            recover=lambda e: absent if isinstance(e, hvac.exceptions.InvalidPath) else None,
        )
        if metadata is absent:
            return {}, 0
        # Versions exist but the latest is deleted or destroyed: a keyring someone removed is
        # not silently replaced by a fresh one.
        raise ConfigError(
            f"{self.description}: the latest version of the secret is deleted or destroyed; "
            "undelete it or remove the secret's metadata deliberately before adding keys"
        )

    def _write(self, fields: dict[str, Any], *, cas: int, what: str) -> bool:
        """One check-and-set write; False when another writer got there first."""
        mismatch: Response = {}

        def on_cas_mismatch(e: hvac.exceptions.VaultError) -> Response | None:
            errors = e.errors if isinstance(e.errors, list) else []
            if isinstance(e, hvac.exceptions.InvalidRequest) and any("check-and-set" in str(x) for x in errors):
                return mismatch
            return None

        response = self.session.call(
            what,
            lambda c: c.secrets.kv.v2.create_or_update_secret(
                path=self.path, secret=fields, cas=cas, mount_point=self.mount
            ),
            recover=on_cas_mismatch,
        )
        return response is not mismatch

    def _next_key_id(self, data: dict[str, Any]) -> str:
        if self.style == "versions":
            return next_version(k for k in data if k not in _RESERVED_FIELDS)
        return f"k-{secrets.token_hex(6)}"

    def _key_length(self) -> int:
        return 16 if self.style == "named" else 32


def _until_written(attempt: Callable[[], _T | None], conflict: str) -> _T:
    """Run a check-and-set ``attempt`` (None: another writer got there first) until it writes,
    re-reading each time so that a concurrent writer's field survives; ConflictError at last."""
    retrying = Retrying(stop=stop_after_attempt(_CAS_ATTEMPTS), wait=wait_random(0, 0.2),
                        retry=retry_if_result(lambda result: result is None), retry_error_callback=lambda _: None)
    result = retrying(attempt)
    if result is None:
        raise ConflictError(conflict)
    return result
