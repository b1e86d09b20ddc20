"""Moved to the PostgreSQL room: ``engines/postgresql/durability.py``. This name stays only for
``drain/run.py`` (``force_flush``) until the drain asks the room itself (docs/engines.md)."""

from __future__ import annotations

from .engines.postgresql.durability import force_flush

__all__ = ["force_flush"]
