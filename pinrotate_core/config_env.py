"""Environment variables over single settings: the ``AliasChoices`` of a settings model name them.

Their strings are converted by the setting's own type, so that the strict model takes
``PINROTATE_BATCH_SIZE=50`` while the file's ``batch_size = "50"`` stays refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import AliasChoices, BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from .config_errors import error_message
from .errors import ConfigError


def _env_settings(model: type[BaseModel], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                                         FieldInfo, str]]:
    """(setting path, field, variable) for every setting an environment variable may override."""
    for name, field in model.model_fields.items():
        if isinstance(field.validation_alias, AliasChoices):
            for variable in field.validation_alias.choices[1:]:
                yield (*path, name), field, str(variable)
        elif isinstance(field.default, BaseModel):
            yield from _env_settings(type(field.default), (*path, name))


class EnvironmentSource(PydanticBaseSettingsSource):
    """The environment variables named in the settings' ``AliasChoices``, as nested settings.

    Their strings are converted by the setting's own type first, so that the strict model takes
    ``PINROTATE_BATCH_SIZE=50`` while the file's ``batch_size = "50"`` stays refused. An empty
    variable overrides nothing. ``origins`` maps each overridden setting to its variable.
    """

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str], source: str) -> None:
        super().__init__(settings_cls)
        self.environ, self.source = environ, source
        self.origins: dict[tuple[str, ...], str] = {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything happens in __call__: settings are nested

    def __call__(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for path, field, variable in _env_settings(self.settings_cls):
            text = self.environ.get(variable)
            if not text:
                continue
            try:
                value = TypeAdapter(field.annotation or str).validate_strings(text)
            except ValidationError as e:
                where = f"{'.'.join(path)} (from {variable})"
                raise ConfigError(f"{self.source}: {where}: {error_message(e.errors(include_input=False)[0])}") from None
            node = data
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
            self.origins[path] = variable
        return data
