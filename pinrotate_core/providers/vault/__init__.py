"""Vault / OpenBao key providers: ``vault-kv`` (a keyring in a KV v2 secret) and ``vault-transit``.

``session`` (hvac client, TLS, login, error translation), ``kv`` (the KV keyring), ``transit``
(the Transit key and its rewrap) and ``transit_batches`` (its ``batch_input`` requests).
"""

from __future__ import annotations

from ...config import KeysSettings
from ...errors import ConfigError, TransitValuesInvalid
from .kv import VaultKvKeyProvider
from .session import Recover, Response, VaultSession, display_addr, translate_vault_error
from .transit import VaultTransitKeyProvider
from .transit_batches import DEFAULT_TRANSIT_ITEMS_PER_REQUEST, TransitBatches, transit_version_or_fail

__all__ = [
    "DEFAULT_TRANSIT_ITEMS_PER_REQUEST", "Recover", "Response", "TransitBatches", "TransitValuesInvalid",
    "VaultKvKeyProvider", "VaultSession", "VaultTransitKeyProvider", "build_vault_provider", "display_addr",
    "transit_version_or_fail", "translate_vault_error",
]


def build_vault_provider(keys: KeysSettings, *, style: str = "versions") -> VaultKvKeyProvider | VaultTransitKeyProvider:
    """The provider for ``keys.provider`` = ``vault-kv`` / ``vault-transit``; validates at construction.

    ``style`` (``versions``: integer versions of 32 bytes / ``named``: named 16-byte keys) only shapes
    the keys ``keys add`` writes to a KV keyring.
    """
    if keys.provider == "vault-kv":
        return VaultKvKeyProvider(keys.vault, style=style)
    if keys.provider == "vault-transit":
        return VaultTransitKeyProvider(keys.vault)
    raise ConfigError(f"keys.provider: {keys.provider} is not a Vault provider")
