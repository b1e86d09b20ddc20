"""Database engines, one room each (as Django's ``db/backends/<vendor>/``): ``base`` says what
every engine provides, ``postgresql`` and ``mysql`` provide it. Callers ask an engine's features
and pieces, never ``if vendor == ...``. This face only tells which room a URL belongs to."""

from __future__ import annotations

from .base.features import ENGINE_OF_SCHEME, engine_of_url

__all__ = ["ENGINE_OF_SCHEME", "engine_of_url"]
