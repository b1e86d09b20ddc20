"""JSON fields of ``fpc1`` targets (``json_paths``): read and rewrite string fields of a document.

A small subset of JSONPath: ``$`` followed by ``.name``, ``['name']`` / ``["name"]`` and
``[index]`` steps, e.g. ``$.password``, ``$.auth.token``, ``$.fields[2].secret``. Rewrites work
on the document's text, replacing only the bytes of the string at each path, so formatting,
number spellings, escapes and key order elsewhere stay exactly as the application wrote them.
No error message here contains a value.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..errors import CiphertextInvalid, ConfigError

JsonStep = str | int

_STEP = re.compile(
    r"""\.(?P<name>[A-Za-z_][A-Za-z0-9_-]*)"""
    r"""|\[(?P<index>0|[1-9][0-9]*)\]"""
    r"""|\['(?P<sq>[^'\\]*)'\]"""
    r"""|\["(?P<dq>[^"\\]*)"\]"""
)
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class JsonPath:
    text: str
    steps: tuple[JsonStep, ...]

    def __str__(self) -> str:
        return self.text


def parse_json_path(path: str | JsonPath) -> JsonPath:
    """Parse ``$.a.b[2]['c d']``; ConfigError naming the path (paths are configuration, not values)."""
    if isinstance(path, JsonPath):
        return path
    if not path.startswith("$"):
        raise ConfigError(f"json path {path!r}: must start with $")
    steps: list[JsonStep] = []
    pos = 1
    while pos < len(path):
        m = _STEP.match(path, pos)
        if m is None:
            raise ConfigError(
                f"json path {path!r}: unsupported syntax at character {pos} "
                "(use .name, ['name'] or [index])"
            )
        if m.group("index") is not None:
            steps.append(int(m.group("index")))
        else:
            for group in ("name", "sq", "dq"):
                if m.group(group) is not None:
                    steps.append(m.group(group))
                    break
        pos = m.end()
    if not steps:
        raise ConfigError(f"json path {path!r}: must name a field, not the whole document")
    return JsonPath(path, tuple(steps))


_MISSING: Final = object()


def _step_into(node: Any, step: JsonStep) -> Any:
    if isinstance(step, int):
        if isinstance(node, list) and step < len(node):
            return node[step]
        return _MISSING
    if isinstance(node, dict) and step in node:
        return node[step]
    return _MISSING


def get_json_path(document: Any, path: str | JsonPath) -> Any:
    """The value at ``path`` in a parsed document; None when absent (like SQL NULL)."""
    node = document
    for step in parse_json_path(path).steps:
        node = _step_into(node, step)
        if node is _MISSING:
            return None
    return node


def set_json_path(document: Any, path: str | JsonPath, value: str) -> None:
    """Replace the existing value at ``path`` in a parsed document (in place; order kept)."""
    parsed = parse_json_path(path)
    node = document
    for step in parsed.steps[:-1]:
        node = _step_into(node, step)
        if node is _MISSING:
            raise LookupError(f"json path {parsed.text} does not exist in the document")
    last = parsed.steps[-1]
    if _step_into(node, last) is _MISSING:
        raise LookupError(f"json path {parsed.text} does not exist in the document")
    node[last] = value


def json_values_in(document: Any, paths: Iterable[str | JsonPath]) -> dict[str, str]:
    """The string at each path of a parsed document (``jsonb``); absent or null paths are skipped.

    A path holding anything but a string or null is CiphertextInvalid naming the path.
    """
    found: dict[str, str] = {}
    for path in paths:
        parsed = parse_json_path(path)
        value = get_json_path(document, parsed)
        if value is None:
            continue
        if not isinstance(value, str):
            raise CiphertextInvalid(f"json path {parsed.text} holds a {_json_type(value)}, not a ciphertext string")
        found[parsed.text] = value
    return found


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "value"


def _load_document(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        # from None: JSONDecodeError carries the whole document in ``.doc``.
        raise CiphertextInvalid("column value is not a JSON document") from None


def extract_json_values(text: str, paths: Iterable[str | JsonPath]) -> dict[str, str]:
    """The encrypted strings of a JSON text column, keyed by path; absent or null paths skipped."""
    return json_values_in(_load_document(text), paths)


def replace_json_values(text: str, replacements: Mapping[str, str]) -> str:
    """``text`` with the string at each path replaced; every other byte of the document is kept.

    Each path must hold a string (the one being replaced). A key that occurs twice in an object on
    a path is refused: which copy the application reads is not ours to guess.
    """
    document = _load_document(text)
    spans: list[tuple[int, int, str]] = []
    for path, new_value in replacements.items():
        parsed = parse_json_path(path)
        if not isinstance(get_json_path(document, parsed), str):
            # LookupError, not TypeError: the schemes catch a path that does not lead to a string value
            raise LookupError(f"json path {parsed.text} does not hold a string in the document")  # noqa: TRY004
        start, end = _locate(text, parsed)
        spans.append((start, end, json.dumps(new_value)))
    spans.sort()
    for (_, end_a, _), (start_b, _, _) in itertools.pairwise(spans):
        if start_b < end_a:
            raise ConfigError("json paths overlap: the same field is named twice")
    pieces: list[str] = []
    pos = 0
    for start, end, encoded in spans:
        pieces.append(text[pos:start])
        pieces.append(encoded)
        pos = end
    pieces.append(text[pos:])
    result = "".join(pieces)
    # Belt and braces: the rewrite must parse to the old document with just these strings changed.
    expected = _load_comparable(text)
    for path, new_value in replacements.items():
        set_json_path(expected, path, new_value)
    if _load_comparable(result) != expected:
        raise CiphertextInvalid("rewriting the JSON document changed more than the named fields")
    return result


@dataclass(frozen=True)
class _Constant:
    """NaN / Infinity as their spelling, so that two parses of one document compare equal."""

    spelling: str


def _load_comparable(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_Constant)
    except (json.JSONDecodeError, RecursionError):
        raise CiphertextInvalid("column value is not a JSON document") from None


def _skip_ws(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _value_end(text: str, pos: int) -> int:
    _, end = _DECODER.raw_decode(text, pos)
    return end


def _locate(text: str, path: JsonPath) -> tuple[int, int]:
    """Start and end offsets of the value at ``path`` in a JSON text already known to parse."""
    pos = _skip_ws(text, 0)
    for step in path.steps:
        pos = _member_start(text, pos, step, path) if isinstance(step, str) else _element_start(text, pos, step, path)
    return pos, _value_end(text, pos)


def _member_start(text: str, pos: int, name: str, path: JsonPath) -> int:
    if text[pos] != "{":
        raise LookupError(f"json path {path.text} does not exist in the document")
    found: int | None = None
    pos = _skip_ws(text, pos + 1)
    if text[pos] == "}":
        raise LookupError(f"json path {path.text} does not exist in the document")
    while True:
        # text[pos] is the opening quote of the member name: decode it as a JSON string.
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _skip_ws(text, pos)
        pos = _skip_ws(text, pos + 1)  # past ':'
        if key == name:
            if found is not None:
                raise CiphertextInvalid(f"json path {path.text}: a key on the path occurs twice in one object")
            found = pos
        pos = _skip_ws(text, _value_end(text, pos))
        if text[pos] == "}":
            break
        pos = _skip_ws(text, pos + 1)  # past ','
    if found is None:
        raise LookupError(f"json path {path.text} does not exist in the document")
    return found


def _element_start(text: str, pos: int, index: int, path: JsonPath) -> int:
    if text[pos] != "[":
        raise LookupError(f"json path {path.text} does not exist in the document")
    pos = _skip_ws(text, pos + 1)
    current = 0
    while text[pos] != "]":
        if current == index:
            return pos
        pos = _skip_ws(text, _value_end(text, pos))
        if text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        current += 1
    raise LookupError(f"json path {path.text} does not exist in the document")
