"""The operator's pause / tune switch: the JSON of a control source (a Prefect Variable) read as a
``ThrottleControl``. Anything not understood pauses fail-safe; never raises, never echoes the value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_BATCH_SIZE = 100_000  # rows: one batch transaction holds this many row locks at most
MAX_DELAY = 3600.0  # seconds between two batches; longer: pause ({"paused": true})

ThrottleControlSource = Callable[[], Any]  # returns a mapping like {"paused": true}, its JSON, or None


class OperatorControl(BaseModel):
    """What an operator may write into the throttle Variable (every field optional, nothing else)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    paused: bool = False
    batch_size: int | None = Field(default=None, ge=1, le=MAX_BATCH_SIZE)
    delay: float | None = Field(default=None, ge=0, le=MAX_DELAY, allow_inf_nan=False)


@dataclass(frozen=True)
class ThrottleControl:
    """What the throttle applies: the operator's pause, batch size and delay, or why it refused them."""

    paused: bool = False
    batch_size: int | None = None
    delay: float | None = None  # seconds between batches, instead of job.inter_batch_delay
    invalid: str | None = None  # why the source's value was refused (then: paused, fail-safe)


def parse_control(value: Any) -> ThrottleControl:
    """A control value (a Prefect Variable's JSON, or that JSON as a string) as a ``ThrottleControl``.

    Absent or empty: no control. A value that is not understood pauses the drain (fail-safe: an
    operator who meant to pause must not get full speed from a typo) and says which field is wrong.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return ThrottleControl()
    try:
        said = (OperatorControl.model_validate_json(value) if isinstance(value, str)
                else OperatorControl.model_validate(value))
    except ValidationError as e:
        return ThrottleControl(paused=True, invalid=_problem(e))
    return ThrottleControl(paused=said.paused, batch_size=said.batch_size, delay=said.delay)


def _problem(error: ValidationError) -> str:
    """The first problem, in the operator's words: the field and the rule (never the value)."""
    first = error.errors(include_url=False, include_input=False)[0]
    if first["type"] == "model_type":
        return "not a JSON object"
    if first["type"] == "json_invalid":
        return "not valid JSON"
    field = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"unknown field {field}"
    return f"{field}: {first['msg']}"
