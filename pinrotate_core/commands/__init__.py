"""The commands' paths per database engine, chosen once from the database URL (as Django picks a
backend once): ``commands_for(settings)`` is the ``EngineCommands`` of the URL's engine, and every
step asks it rather than ``if vendor == ...`` (``rotation``'s steps, ``flows.cli``, ``flows.seed_cli``).

``base`` says what each engine provides, ``postgresql`` and ``mysql`` provide it over the core's
modules. The engine rooms (``engines/``) never import this package: it sits above them."""

from __future__ import annotations

from ..config import Settings
from ..engines import engine_of_url
from .base import EngineCommands
from .mysql import MYSQL
from .postgresql import POSTGRESQL

__all__ = ["EngineCommands", "commands_for"]

COMMANDS: dict[str, EngineCommands] = {"postgresql": POSTGRESQL, "mysql": MYSQL}


def commands_for(source: Settings | str | None) -> EngineCommands:
    """The commands of a configuration's database, or of a URL; no URL is the embedded PostgreSQL.
    ConfigError (one line, no URL) for a scheme pinrotate does not know."""
    url = source.database.url if isinstance(source, Settings) else source
    return COMMANDS["postgresql" if url is None else engine_of_url(url)]
