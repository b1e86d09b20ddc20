"""The Vault / OpenBao session: an hvac client, TLS, namespace, and token / AppRole / Kubernetes login.

hvac and requests errors are translated here, narrowly, into ``KeyUnavailable`` (retryable or not)
or ``ConfigError`` naming the address, mount, path, key and field. Never let a token, secret id,
JWT, key material, plaintext or ciphertext reach a message, a log line or a repr: hvac's exception
texts carry response bodies, so they are neither embedded nor chained.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import hvac
import hvac.exceptions
import requests

from ...config import VaultSettings
from ...errors import ConfigError, KeyUnavailable, PinrotateError
from ...log import log_event

Response = dict[str, Any]
# A hook that may turn a Vault error into a usable response (a CAS mismatch, a 404 that means
# "absent", a batch answered with 400); None means "translate and raise as usual".
Recover = Callable[[hvac.exceptions.VaultError], "Response | None"]

_DEFAULT_AUTH_MOUNTS = {"token": "token", "approle": "approle", "kubernetes": "kubernetes"}

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
