"""Configuration errors in the operator's terms: the TOML file's names, never pydantic's.

A ``[[targets]]`` table is named by its ``name``, an array entry by its 1-based position, a type by
its TOML name; an environment variable that set a value is named. Never a value: a URL or a token
may sit beside the setting that is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

TARGET_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def describe_validation_error(e: ValidationError, origins: Mapping[tuple[str, ...], str] | None = None,
                              data: Mapping[str, Any] | None = None) -> str:
    """First error as ``dotted.setting: message`` in the file's own terms; pydantic's input value is
    deliberately left out.

    A ``[[targets]]`` table is named by its ``name`` (or its 1-based position when it has no usable
    name), an array entry by its 1-based position, a type by its TOML name ("must be an array").
    A setting that came from an environment variable is named with it, so the operator looks there
    and not in the file.
    """
    errors = e.errors(include_url=False, include_input=False)
    err = errors[0]
    var = (origins or {}).get(tuple(str(i) for i in err["loc"]))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{_toml_location(err['loc'], data) or 'configuration'}{f' (from {var})' if var else ''}: " \
           f"{error_message(err)}{more}"


def _toml_location(loc: tuple[int | str, ...], data: Mapping[str, Any] | None) -> str:
    if len(loc) >= 2 and loc[0] == "targets" and isinstance(loc[1], int):
        tables = (data or {}).get("targets")
        table = tables[loc[1]] if isinstance(tables, (list, tuple)) and loc[1] < len(tables) else None
        name = table.get("name") if isinstance(table, Mapping) else None
        where = (f'target "{name}"' if isinstance(name, str) and TARGET_NAME.fullmatch(name)
                 else f"[[targets]] table {loc[1] + 1}")
        rest = _toml_location(loc[2:], None)
        return f"{where}: {rest}" if rest else where
    text = ""
    for item in loc:
        text += f" entry {item + 1}" if isinstance(item, int) else (f".{item}" if text else str(item))
    return text


# pydantic's words for types, in TOML's: the operator edits a TOML file, not a Python object.
_TOML_TYPES = {
    "tuple_type": "must be an array", "list_type": "must be an array",
    "int_type": "must be an integer", "int_parsing": "must be an integer", "int_from_float": "must be an integer",
    "float_type": "must be a number", "float_parsing": "must be a number",
    "string_type": "must be a string", "bool_type": "must be true or false", "bool_parsing": "must be true or false",
    "dict_type": "must be a table", "model_type": "must be a table", "model_attributes_type": "must be a table",
    "finite_number": "must be a finite number (not inf or nan)",
}


def error_message(err: Any) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown setting"
    if kind == "missing":
        return "required setting is missing"
    if kind == "string_pattern_mismatch":
        return f"must match {err['ctx']['pattern'].strip('^$')}"
    if kind in _TOML_TYPES:
        return _TOML_TYPES[kind]
    if kind == "too_short":
        return f"must hold at least {err['ctx']['min_length']} entry" + ("s" if err["ctx"]["min_length"] > 1 else "")
    return str(err["msg"]).removeprefix("Value error, ").replace("Input should be", "must be")
