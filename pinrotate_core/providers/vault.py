"""Vault / OpenBao key providers: ``vault-kv`` (a keyring in a KV v2 secret) and ``vault-transit``.

hvac and requests errors are translated here, narrowly, into ``KeyUnavailable`` (retryable or not)
or ``ConfigError`` naming the address, mount, path, key and field. Never let a token, secret id,
JWT, key material, plaintext or ciphertext reach a message, a log line or a repr: hvac's exception
texts carry response bodies, so they are neither embedded nor chained.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import hvac
import hvac.exceptions
import requests
from tenacity import Retrying, retry_if_result, stop_after_attempt, wait_random

from ..config import KeysSettings, VaultSettings
from ..errors import (
    CiphertextInvalid,
    ConfigError,
    ConflictError,
    KeyUnavailable,
    PinrotateError,
    TransitValuesInvalid,
)
from ..keyring import Key, Keyring, check_key_ids, next_version, shown_key_id, shown_name, validate_key_id
from ..log import log_event
from ..schemes.transit import transit_version
from ._material import decode_key, normalise_current

Response = dict[str, Any]
# A hook that may turn a Vault error into a usable response (a CAS mismatch, a 404 that means
# "absent", a batch answered with 400); None means "translate and raise as usual".
Recover = Callable[[hvac.exceptions.VaultError], "Response | None"]

_DEFAULT_AUTH_MOUNTS = {"token": "token", "approle": "approle", "kubernetes": "kubernetes"}
_RESERVED_FIELDS = frozenset({"current", "legacy"})
# OpenBao (>= 2.4.1) refuses request bodies with more than 1000 JSON strings by default
# (listener max_request_json_strings); a batch item costs two ("ciphertext": value), so 490 items
# plus the envelope stay below it. Servers with higher limits can be given a larger value.
DEFAULT_TRANSIT_ITEMS_PER_REQUEST = 490
# KV check-and-set attempts before a ConflictError (see _until_written).
_CAS_ATTEMPTS = 5
_T = TypeVar("_T")

# hvac keeps the HTTP status only in the exception class; (status, fixed reason, retryable).
_HTTP_FAILURES: tuple[tuple[type[hvac.exceptions.VaultError], int | None, str, bool], ...] = (
    (hvac.exceptions.InvalidRequest, 400, "bad request", False),
    (hvac.exceptions.Unauthorized, 401, "unauthorized", False),
    (hvac.exceptions.Forbidden, 403, "permission denied (token revoked, expired or without a policy for this path)", False),
    (hvac.exceptions.InvalidPath, 404, "not found", False),
    (hvac.exceptions.RateLimitExceeded, 429, "rate limited", True),
    (hvac.exceptions.InternalServerError, 500, "internal server error", True),
    (hvac.exceptions.VaultNotInitialized, 501, "not initialized", True),
    (hvac.exceptions.BadGateway, 502, "bad gateway", True),
    (hvac.exceptions.VaultDown, 503, "sealed or unavailable", True),
    (hvac.exceptions.UnexpectedError, None, "unexpected response status", True),
)


def translate_vault_error(error: Exception, *, addr: str, what: str, timeout: float | None = None,
                          not_found: str | None = None) -> PinrotateError:
    """A pinrotate error for an hvac / requests failure: status code and a fixed reason, no body."""
    prefix = f"Vault at {addr}: {what}"
    if isinstance(error, hvac.exceptions.InvalidPath) and not_found:
        return KeyUnavailable(f"{prefix}: {not_found} (HTTP 404)", retryable=False)
    if isinstance(error, hvac.exceptions.VaultError):
        for cls, status, reason, retryable in _HTTP_FAILURES:
            if isinstance(error, cls):
                code = f" (HTTP {status})" if status is not None else ""
                return KeyUnavailable(f"{prefix}: {reason}{code}", retryable=retryable)
        # Raised by hvac itself before any request (bad parameters, unsupported operation).
        return ConfigError(f"{prefix}: rejected by the Vault client ({type(error).__name__})")
    if isinstance(error, requests.exceptions.SSLError):
        return KeyUnavailable(
            f"{prefix}: TLS verification failed (check keys.vault.ca_cert / VAULT_CACERT)", retryable=False
        )
    if isinstance(error, requests.exceptions.Timeout):
        after = f" after {timeout:g} s" if timeout else ""
        return KeyUnavailable(f"{prefix}: timed out{after} ({type(error).__name__})", retryable=True)
    if isinstance(error, requests.exceptions.ConnectionError):
        return KeyUnavailable(f"{prefix}: cannot connect (refused or unreachable)", retryable=True)
    if isinstance(error, (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema,
                          requests.exceptions.InvalidSchema)):
        return ConfigError("keys.vault.addr: not a usable http(s) URL")
    if isinstance(error, requests.exceptions.RequestException):
        return KeyUnavailable(f"{prefix}: request failed ({type(error).__name__})", retryable=True)
    raise TypeError(f"not a Vault client error: {type(error).__name__}")  # a programming error


def display_addr(addr: str) -> str:
    """``scheme://host:port`` of a Vault address: no user info, path or query in any message."""
    try:
        parts = urlsplit(addr.strip())
        port = parts.port
    except ValueError:
        raise ConfigError("keys.vault.addr: not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError("keys.vault.addr: must be an http:// or https:// URL with a host")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _read_secret_file(path: str, *, setting: str) -> str:
    """A credential from a file (AppRole secret id, service-account JWT); errors name the path only."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{setting}: cannot read {path} ({type(e).__name__})") from None
    if not text:
        raise ConfigError(f"{setting}: {path} is empty")
    return text


class VaultSession:
    """An hvac client built from ``VaultSettings``, logged in once on first use.

    Token auth uses ``keys.vault.token`` (``VAULT_TOKEN`` overrides it through the configuration);
    AppRole logs in with role_id + secret_id (or secret_id_file); Kubernetes with the role and the
    service-account JWT read from ``jwt_file``. TLS is verified unless ``verify = false``.
    """

    def __init__(self, settings: VaultSettings) -> None:
        if not settings.addr:
            raise ConfigError("keys.vault.addr: required setting is missing (or set VAULT_ADDR)")
        self.addr = display_addr(settings.addr)
        self.auth = settings.auth
        self.auth_mount = (settings.auth_mount or _DEFAULT_AUTH_MOUNTS[settings.auth]).strip("/")
        self.namespace = settings.namespace or None
        self.timeout = settings.timeout
        if settings.auth == "token" and not settings.token:
            raise ConfigError("keys.vault.token: required for auth = \"token\" (or set VAULT_TOKEN)")
        if settings.auth == "approle" and not (settings.secret_id or settings.secret_id_file):
            raise ConfigError("keys.vault.secret_id: auth = \"approle\" needs secret_id or secret_id_file")
        if settings.ca_cert and not Path(settings.ca_cert).expanduser().is_file():
            raise ConfigError(f"keys.vault.ca_cert: {settings.ca_cert} is not a file")
        self.verify: bool | str = (
            False if not settings.verify
            else (str(Path(settings.ca_cert).expanduser()) if settings.ca_cert else True)
        )
        host = urlsplit(self.addr).hostname or ""
        if self.addr.startswith("http://") and not _is_loopback(host):
            log_event("vault_plaintext_http", level=logging.WARNING, addr=self.addr)
        self._settings = settings
        self._client: hvac.Client | None = None
        self._lock = threading.Lock()  # parallel drains share one session: log in once
        self.logins = 0  # completed AppRole / Kubernetes logins (one per session unless a token expires)

    def __repr__(self) -> str:
        ns = f", namespace={self.namespace!r}" if self.namespace else ""
        return f"VaultSession(addr={self.addr!r}, auth={self.auth!r}, auth_mount={self.auth_mount!r}{ns})"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("VaultSession cannot be pickled: it holds a Vault token")

    # -- client and login ----------------------------------------------------------------------

    def client(self) -> hvac.Client:
        """The authenticated client; logs in on first use (AppRole / Kubernetes)."""
        with self._lock:
            return self._client if self._client is not None else self._new_client()

    def _new_client(self) -> hvac.Client:
        s = self._settings
        # token="" rather than None: hvac would otherwise pick up VAULT_TOKEN or ~/.vault-token
        # behind the configuration's back.
        client = hvac.Client(
            url=s.addr, token=s.token if s.auth == "token" else "", verify=self.verify,
            timeout=self.timeout, namespace=self.namespace,
        )
        if s.auth == "approle":
            self._login_approle(client)
        elif s.auth == "kubernetes":
            self._login_kubernetes(client)
        self._client = client
        return client

    def _login_approle(self, client: hvac.Client) -> None:
        s = self._settings
        secret_id = s.secret_id or _read_secret_file(str(s.secret_id_file), setting="keys.vault.secret_id_file")
        self._request(
            client, f"approle login at auth/{self.auth_mount}",
            lambda c: c.auth.approle.login(role_id=s.role_id, secret_id=secret_id, mount_point=self.auth_mount),
        )
        self.logins += 1
        log_event("vault_login", auth="approle", mount=self.auth_mount, addr=self.addr)

    def _login_kubernetes(self, client: hvac.Client) -> None:
        s = self._settings
        jwt = _read_secret_file(s.jwt_file, setting="keys.vault.jwt_file")
        self._request(
            client, f"kubernetes login as role {s.role} at auth/{self.auth_mount}",
            lambda c: c.auth.kubernetes.login(role=s.role, jwt=jwt, mount_point=self.auth_mount),
        )
        self.logins += 1
        log_event("vault_login", auth="kubernetes", role=s.role, mount=self.auth_mount, addr=self.addr)

    # -- requests ------------------------------------------------------------------------------

    def call(self, what: str, operation: Callable[[hvac.Client], Any], *, not_found: str | None = None,
             recover: Recover | None = None) -> Any:
        """Run one Vault request, translating every failure. ``what`` names the operation, never a value.

        With AppRole / Kubernetes auth a 403 logs in once more and retries: the login token may
        simply have expired during a long run. A revoked static token is not retried.
        """
        relogin = self.auth != "token"
        for attempt in (1, 2):
            client = self.client()
            try:
                return self._request(client, what, operation, not_found=not_found, recover=recover,
                                     passthrough_forbidden=relogin and attempt == 1)
            except hvac.exceptions.Forbidden:
                with self._lock:
                    if self._client is client:  # another thread may have logged in again already
                        self._client = None
        raise AssertionError("unreachable: the second attempt raises or returns")

    def _request(self, client: hvac.Client, what: str, operation: Callable[[hvac.Client], Any], *,
                 not_found: str | None = None, recover: Recover | None = None,
                 passthrough_forbidden: bool = False) -> Any:
        failure: PinrotateError
        try:
            return operation(client)
        except hvac.exceptions.VaultError as e:
            if passthrough_forbidden and isinstance(e, hvac.exceptions.Forbidden):
                raise
            recovered = recover(e) if recover is not None else None
            if recovered is not None:
                return recovered
            failure = translate_vault_error(e, addr=self.addr, what=what, not_found=not_found)
        except requests.exceptions.RequestException as e:
            failure = translate_vault_error(e, addr=self.addr, what=what, timeout=self.timeout)
        # Raised outside the except block on purpose: neither __cause__ nor __context__ may carry
        # the library exception, whose text can hold a response body.
        log_event("vault_request_failed", level=logging.WARNING, addr=self.addr, what=what,
                  retryable=getattr(failure, "retryable", None), error=type(failure).__name__)
        raise failure


# ---------------------------------------------------------------------------------------------
# vault-kv


class VaultKvKeyProvider:
    """The keyring from a KV v2 secret: fields ``current``, ``1``, ``2``, ... (base64), ``legacy``.

    The secret is read once per provider instance and cached: one read per run, never per row.
    ``add_key`` writes a new field without moving ``current``; ``promote`` moves it in a second
    write. Both use KV check-and-set, so a concurrent writer's change is never lost.
    """

    def __init__(self, settings: VaultSettings, *, style: str = "aesgcm", session: VaultSession | None = None) -> None:
        if style not in ("aesgcm", "fpc1"):
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
        if self.style == "aesgcm":
            return next_version(k for k in data if k not in _RESERVED_FIELDS)
        return f"k-{secrets.token_hex(6)}"

    def _key_length(self) -> int:
        return 16 if self.style == "fpc1" else 32


# ---------------------------------------------------------------------------------------------
# vault-transit


class VaultTransitKeyProvider:
    """The Transit key as a server-side keyring: its ``latest_version`` is the current version.

    No key material ever reaches this process; values move to the latest version with ``rewrap``
    (one ``batch_input`` request per batch), so no plaintext does either.
    """

    def __init__(self, settings: VaultSettings, *, session: VaultSession | None = None,
                 max_items_per_request: int = DEFAULT_TRANSIT_ITEMS_PER_REQUEST) -> None:
        if max_items_per_request < 1:
            raise ValueError("max_items_per_request must be >= 1")
        if not settings.key:
            raise ConfigError("keys.vault.key: required for provider \"vault-transit\"")
        self.mount = settings.transit_mount.strip("/")
        if not self.mount:
            raise ConfigError("keys.vault.transit_mount: must name the Transit mount")
        self.key_name = settings.key
        self.description = f"vault-transit {self.mount}/{self.key_name}"
        self.session = session if session is not None else VaultSession(settings)
        self.max_items_per_request = max_items_per_request
        self._keyring: Keyring | None = None

    def __repr__(self) -> str:
        return f"VaultTransitKeyProvider({self.description!r}, addr={self.session.addr!r})"

    # -- key state -----------------------------------------------------------------------------

    def load_keyring(self) -> Keyring:
        """Read once per instance: the run works towards the version current at its start."""
        if self._keyring is None:
            info = self.key_info()  # one read gives both versions
            latest = self._version_field(info, "latest_version")
            oldest = self._version_field(info, "min_decryption_version")
            self._keyring = Keyring(current=str(latest), keys={}, source=self.description, server_side=True,
                                    min_decryption_version=oldest)
            log_event("keyring_loaded", source=self.description, current=latest, min_decryption_version=oldest)
        return self._keyring

    def key_info(self) -> dict[str, Any]:
        """The Transit key's metadata (versions, flags; no material). Read fresh on every call."""
        response = self.session.call(
            f"read transit key {self.key_name} at {self.mount}",
            lambda c: c.secrets.transit.read_key(name=self.key_name, mount_point=self.mount),
            not_found=f"transit key {self.key_name} does not exist at mount {self.mount}",
        )
        data = response.get("data") if isinstance(response, dict) else None
        if not isinstance(data, dict):
            raise KeyUnavailable(f"{self.description}: unexpected answer when reading the key", retryable=False)
        if data.get("supports_encryption") is False or data.get("supports_decryption") is False:
            raise ConfigError(f"{self.description}: key type {data.get('type')} does not support encryption")
        if data.get("derived"):
            raise ConfigError(f"{self.description}: derived keys need a per-value context, which pinrotate does not keep")
        return data

    def current_version(self) -> int:
        return self._version_field(self.key_info(), "latest_version")

    def min_decryption_version(self) -> int:
        return self._version_field(self.key_info(), "min_decryption_version")

    def _version_field(self, info: dict[str, Any], name: str) -> int:
        value = info.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KeyUnavailable(f"{self.description}: key has no valid {name}", retryable=False)
        return value

    def rotate(self) -> int:
        """``keys rotate``: a new key version in Vault; returns the new latest version."""
        self.session.call(
            f"rotate transit key {self.key_name} at {self.mount}",
            lambda c: c.secrets.transit.rotate_key(name=self.key_name, mount_point=self.mount),
            not_found=f"transit key {self.key_name} does not exist at mount {self.mount}",
        )
        self._keyring = None
        latest = self.current_version()
        log_event("transit_key_rotated", source=self.description, current=latest)
        return latest

    # -- batches -------------------------------------------------------------------------------

    def rewrap(self, values: Sequence[str]) -> list[str]:
        """Move every value to the latest key version; order preserved, no plaintext here.

        One request per batch of up to ``max_items_per_request`` values (see ``_batch``).

        Raises ``TransitValuesInvalid`` (with positions) for values Transit refuses, and
        ``KeyUnavailable`` for values on a version below ``min_decryption_version``.
        """
        if not values:
            return []
        versions = self._input_versions(values, "rewrap")
        results = self._batch(
            "rewrap", [{"ciphertext": v} for v in values], versions,
            lambda c, batch: c.secrets.transit.rewrap_data(
                name=self.key_name, ciphertext=None, batch_input=batch, mount_point=self.mount
            ),
        )
        out: list[str] = []
        for pos, result in enumerate(results):
            new_value = result.get("ciphertext")
            if not isinstance(new_value, str) or transit_version_or_fail(new_value, self.description) < versions[pos]:
                raise KeyUnavailable(f"{self.description}: rewrap returned an unusable value at position {pos}",
                                     retryable=False)
            out.append(new_value)
        return out

    def encrypt(self, plaintexts: Sequence[bytes]) -> list[str]:
        """Encrypt under the latest version, one request (tests, verification, demo data)."""
        if not plaintexts:
            return []
        results = self._batch(
            "encrypt", [{"plaintext": base64.b64encode(p).decode("ascii")} for p in plaintexts], None,
            lambda c, batch: c.secrets.transit.encrypt_data(
                name=self.key_name, batch_input=batch, mount_point=self.mount
            ),
        )
        out: list[str] = []
        for pos, result in enumerate(results):
            value = result.get("ciphertext")
            if not isinstance(value, str):
                raise KeyUnavailable(f"{self.description}: encrypt returned no value at position {pos}", retryable=False)
            transit_version_or_fail(value, self.description)
            out.append(value)
        return out

    def decrypt(self, values: Sequence[str]) -> list[bytes]:
        """Decrypt in one request (verification through Transit); order preserved."""
        if not values:
            return []
        versions = self._input_versions(values, "decrypt")
        results = self._batch(
            "decrypt", [{"ciphertext": v} for v in values], versions,
            lambda c, batch: c.secrets.transit.decrypt_data(
                name=self.key_name, ciphertext=None, batch_input=batch, mount_point=self.mount
            ),
        )
        out: list[bytes] = []
        for pos, result in enumerate(results):
            encoded = result.get("plaintext") or ""  # Transit leaves the field out for an empty value
            try:
                out.append(base64.b64decode(encoded, validate=True))
            except (binascii.Error, ValueError, TypeError):
                raise KeyUnavailable(f"{self.description}: decrypt returned an unusable value at position {pos}",
                                     retryable=False) from None
        return out

    def _input_versions(self, values: Sequence[str], operation: str) -> list[int]:
        """Key versions of the inputs; values that are not ``vault:v<N>:`` never go to Vault."""
        versions: list[int] = []
        bad: list[int] = []
        for pos, value in enumerate(values):
            try:
                versions.append(transit_version(value))
            except CiphertextInvalid:
                versions.append(0)
                bad.append(pos)
        if bad:
            raise TransitValuesInvalid(
                f"{self.description}: {operation}: {len(bad)} of {len(values)} values are not vault-transit "
                f"ciphertexts (positions {_positions(bad)})", bad,
            )
        return versions

    def _batch(self, operation: str, items: list[dict[str, str]], versions: list[int] | None,
               send: Callable[[hvac.Client, list[dict[str, str]]], Any]) -> list[dict[str, Any]]:
        """``batch_input`` requests of at most ``max_items_per_request`` items; results in input order.

        A batch within the limit is ONE request. A server that refuses a request as too complex
        (OpenBao's ``max_request_json_strings``) gets the same items again in halves, and the
        smaller size is kept for the rest of the run.
        """
        results: list[dict[str, Any]] = []
        start = 0
        while start < len(items):
            size = min(self.max_items_per_request, len(items) - start)
            answer = self._request_batch(operation, items[start:start + size], send)
            if answer is None:
                if size == 1:
                    raise KeyUnavailable(
                        f"{self.description}: {operation}: the server refuses even one value per request "
                        "as too complex (check its listener's max_request_json_* limits)", retryable=False,
                    )
                self.max_items_per_request = max(1, size // 2)
                log_event("transit_batch_limit_lowered", source=self.description,
                          max_items_per_request=self.max_items_per_request)
                continue
            results.extend(answer)
            start += size
        failed: list[int] = []
        too_old: list[int] = []
        for pos, result in enumerate(results):
            error = result.get("error")
            if error:
                (too_old if "too old" in str(error) or "disallowed by policy" in str(error) else failed).append(pos)
        if too_old and versions is not None:
            below = sorted({versions[p] for p in too_old})
            raise KeyUnavailable(
                f"{self.description}: {operation}: {len(too_old)} values are on key versions "
                f"{','.join(map(str, below))}, below the key's min_decryption_version", retryable=False,
            )
        failed = sorted(failed + too_old)
        if failed:
            if operation == "encrypt":
                raise KeyUnavailable(f"{self.description}: encrypt refused {len(failed)} of {len(items)} values",
                                     retryable=False)
            raise TransitValuesInvalid(
                f"{self.description}: {operation}: Transit refused {len(failed)} of {len(items)} values "
                f"(positions {_positions(failed)})", failed,
            )
        return results

    def _request_batch(self, operation: str, chunk: list[dict[str, str]],
                       send: Callable[[hvac.Client, list[dict[str, str]]], Any]) -> list[dict[str, Any]] | None:
        """One request; None when the server refused it as too complex (too many items)."""
        too_complex: Response = {}

        def recover(e: hvac.exceptions.VaultError) -> Response | None:
            if not isinstance(e, hvac.exceptions.InvalidRequest):
                return None
            errors = e.errors if isinstance(e.errors, list) else []
            if any("JSON input" in str(x) and ("complexity" in str(x) or "exceed" in str(x)) for x in errors):
                return too_complex
            # Vault answers a batch with item errors by HTTP 400 (OpenBao by 200): same results.
            body = e.json
            if isinstance(body, dict) and isinstance((body.get("data") or {}).get("batch_results"), list):
                return body
            return None

        response = self.session.call(
            f"{operation} {len(chunk)} values with transit key {self.key_name} at {self.mount}",
            lambda c: send(c, chunk),
            not_found=f"transit key {self.key_name} does not exist at mount {self.mount}",
            recover=recover,
        )
        if response is too_complex:
            return None
        # No per-item "reference": it would double the strings per request, and Transit answers
        # in input order; the count and shape are checked instead.
        results = (response.get("data") or {}).get("batch_results") if isinstance(response, dict) else None
        if not isinstance(results, list) or len(results) != len(chunk) or not all(isinstance(r, dict) for r in results):
            raise KeyUnavailable(f"{self.description}: {operation}: incomplete batch answer", retryable=False)
        return results


def transit_version_or_fail(value: str, where: str) -> int:
    """Version of a value Vault just returned; a malformed one means the answer cannot be trusted."""
    try:
        return transit_version(value)
    except CiphertextInvalid:
        raise KeyUnavailable(f"{where}: Vault returned a value that is not vault:v<N>:", retryable=False) from None


def _positions(positions: Sequence[int], limit: int = 20) -> str:
    shown = ",".join(str(p) for p in positions[:limit])
    return shown + (f",... ({len(positions) - limit} more)" if len(positions) > limit else "")


# ---------------------------------------------------------------------------------------------


def build_vault_provider(keys: KeysSettings, *, style: str = "aesgcm") -> VaultKvKeyProvider | VaultTransitKeyProvider:
    """The provider for ``keys.provider`` = ``vault-kv`` / ``vault-transit``; validates at construction.

    ``style`` (``aesgcm`` integer versions of 32 bytes / ``fpc1`` named 16-byte keys) only shapes
    the keys ``keys add`` writes to a KV keyring.
    """
    if keys.provider == "vault-kv":
        return VaultKvKeyProvider(keys.vault, style=style)
    if keys.provider == "vault-transit":
        return VaultTransitKeyProvider(keys.vault)
    raise ConfigError(f"keys.provider: {keys.provider} is not a Vault provider")


def _until_written(attempt: Callable[[], _T | None], conflict: str) -> _T:
    """Run a check-and-set ``attempt`` (None: another writer got there first) until it writes,
    re-reading each time so that a concurrent writer's field survives; ConflictError at last."""
    retrying = Retrying(stop=stop_after_attempt(_CAS_ATTEMPTS), wait=wait_random(0, 0.2),
                        retry=retry_if_result(lambda result: result is None), retry_error_callback=lambda _: None)
    result = retrying(attempt)
    if result is None:
        raise ConflictError(conflict)
    return result
