"""``vault-transit``: the Transit key as a server-side keyring (versions, rotate) and its rewrap."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...config import VaultSettings
from ...errors import ConfigError, KeyUnavailable
from ...keyring import Keyring
from ...log import log_event
from .session import VaultSession
from .transit_batches import DEFAULT_TRANSIT_ITEMS_PER_REQUEST, TransitBatches, transit_version_or_fail


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
        self.batches = TransitBatches(self.session, self.mount, self.key_name, self.description, max_items_per_request)
        self._keyring: Keyring | None = None

    def __repr__(self) -> str:
        return f"VaultTransitKeyProvider({self.description!r}, addr={self.session.addr!r})"

    @property
    def max_items_per_request(self) -> int:
        """Values per ``batch_input`` request; lowered for the rest of the run when the server
        refuses a request as too complex."""
        return self.batches.max_items_per_request

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

    # -- rewrap --------------------------------------------------------------------------------

    def rewrap(self, values: Sequence[str]) -> list[str]:
        """Move every value to the latest key version; order preserved, no plaintext here.

        One request per batch of up to ``max_items_per_request`` values (see ``TransitBatches.run``).

        Raises ``TransitValuesInvalid`` (with positions) for values Transit refuses, and
        ``KeyUnavailable`` for values on a version below ``min_decryption_version``.
        """
        if not values:
            return []
        versions = self.batches.input_versions(values, "rewrap")
        results = self.batches.run(
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
