"""What PostgreSQL can do (``base.features``)."""

from __future__ import annotations

from ..base.features import Features

FEATURES = Features(name="postgresql", has_row_versions=True, has_skip_locked=True, has_row_security=True,
                    can_silence_triggers=True, has_auto_updated_columns=False, schema_is_database=False,
                    prepared_per_database=True)
