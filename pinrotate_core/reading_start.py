"""The start every command that reads a database shares (``inventory``, ``gate --retire``), on
either engine: reach the server, add Forge's own tables where configured, check ``--tenant``
against every target, read the keyring. In this order: a low-code configuration added since the
file was written is inside the check, and nothing is read before the server answers (exit 4)."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from .config import Settings
from .db import database_url, make_engine
from .forge_discovery import with_forge_targets
from .keyring import Keyring
from .providers import KeyProvider, build_provider
from .scope import check_tenant_scope


@dataclass(frozen=True)
class ReadingStart:
    engine: sa.Engine  # the caller disposes of it
    settings: Settings  # with Forge's discovered targets
    provider: KeyProvider
    keyring: Keyring


def start_reading(settings: Settings, tenant: str | None, *, pool_size: int) -> ReadingStart:
    """The engine is disposed of here if any step fails; otherwise by the caller."""
    engine = make_engine(database_url(settings), pool_size=pool_size)
    try:
        settings = with_forge_targets(settings, engine)
        check_tenant_scope(settings.targets, tenant)
        provider = build_provider(settings)
        return ReadingStart(engine, settings, provider, provider.load_keyring())
    except BaseException:
        engine.dispose()
        raise
