"""Key providers: where the keyring of a run comes from.

One small port (``KeyProvider``) with one module per implementation. Providers validate at
construction and on ``load_keyring``, so a bad key stops the start instead of failing on row 80,000.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import ConfigError
from ..keyring import Keyring
from ..schemes.base import LegacyMigration, OrderedKeys
from ..schemes.registry import scheme_class

if TYPE_CHECKING:
    from ..config import Settings


@runtime_checkable
class KeyProvider(Protocol):
    """Reads the keyring of one run. ``description`` names the source, never a secret."""

    description: str

    def load_keyring(self) -> Keyring: ...


@runtime_checkable
class KeyringAdmin(KeyProvider, Protocol):
    """Providers whose keyring pinrotate may change: add a key read-only first, promote it later."""

    def add_key(self, key_id: str | None = None) -> str: ...

    def promote(self, key_id: str) -> None: ...


def keyring_style(settings: Settings) -> str:
    """The keys a keyring pinrotate adds to holds (the style's name is kept in ``pinrotate.key_checks``):
    ``versions`` (integer versions) when some target's scheme orders its keys by version, else
    ``named`` (named 16-byte keys)."""
    ordered = any(isinstance(scheme_class(t.format), OrderedKeys) for t in settings.targets)
    return "versions" if ordered else "named"


def build_provider(settings: Settings, *, create_keyring: bool = False) -> KeyProvider:
    """The configured provider. ``create_keyring``: a ``file`` keyring absent on disk is created
    by ``load_keyring`` (a run's first start, ``keys add``); elsewhere it is refused, never made up."""
    keys = settings.keys
    if keys.provider == "file":
        from .file import FileKeyProvider

        return FileKeyProvider(keys.file_path, style=keyring_style(settings), create=create_keyring)
    if keys.provider == "env":
        from .env import EnvKeyProvider

        return EnvKeyProvider()
    if keys.provider == "k8s-dir":
        from .k8s import K8sDirKeyProvider

        assert keys.dir is not None  # checked by KeysSettings
        return K8sDirKeyProvider(keys.dir)
    if keys.provider == "forge":
        from .forge import ForgeKeyProvider

        # Forge's keyring (its legacy key and switches included) serves the scheme that migrates Forge's values.
        other = [t for t in settings.targets if not isinstance(scheme_class(t.format), LegacyMigration)]
        if other:
            raise ConfigError(f"keys.provider = forge: Forge's keyring serves fpc1 targets only; target"
                              f" {other[0].name} has format {other[0].format}")
        return ForgeKeyProvider(keys.file)
    if keys.provider in ("vault-kv", "vault-transit"):
        try:
            from . import vault
        except ImportError as e:  # pragma: no cover - hvac is a hard dependency
            raise ConfigError(f"keys.provider = {keys.provider}: the Vault providers need hvac") from e
        return vault.build_vault_provider(keys, style=keyring_style(settings))
    raise ConfigError(f"keys.provider: unknown provider {keys.provider}")
