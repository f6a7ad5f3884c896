"""Reading what a file says: JSON from strangers, parsed as data and checked, never trusted.

Every JSON file or string vitrim reads (``run.json``, a hub repo's ``config.json`` and ``preprocessor_config.json``,
a shard set's ``_info.json``, a checkpoint's metadata) comes through :func:`parse_json` or :func:`read_json`, so that
a hostile file ends in one ``ValueError`` that names the file and says what was expected, never in Python's words:

* the text must be UTF-8 and at most ``MAX_JSON_BYTES`` long (a config is kilobytes; a shard index a few MB);
* nesting deeper than ``MAX_JSON_DEPTH`` is refused before the parser recurses (Python's parser raises
  ``RecursionError`` on ``"[" * 100000``);
* ``NaN``, ``Infinity`` and ``-Infinity`` (which Python's ``json`` accepts although JSON does not) are refused:
  no field of any file vitrim reads may be non-finite.

The caller then checks the shape it documents with :func:`expect_object`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 64 * 2**20  # the largest sharded-checkpoint index seen is ~100 kB; configs are a few kB
MAX_JSON_DEPTH = 64  # the deepest file vitrim documents nests 4 levels


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"the non-finite number {name}, which JSON does not allow")


def _depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` outside strings: O(len) and no recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def parse_json(text: str | bytes, source: str) -> Any:
    """Parse JSON read from outside; ``source`` names it in the error (a path, or "checkpoint metadata 'x'")."""
    if len(text) > MAX_JSON_BYTES:
        raise ValueError(f"{source}: {len(text)} bytes of JSON, over the limit of {MAX_JSON_BYTES}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}: not UTF-8 text (byte {e.start}); expected a JSON file") from None
    if (deepest := _depth(text)) > MAX_JSON_DEPTH:
        raise ValueError(f"{source}: JSON nested {deepest} levels deep, over the limit of {MAX_JSON_DEPTH}")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def read_json(path: str | Path, source: str | None = None) -> Any:
    """Read and parse a JSON file from outside (see :func:`parse_json`); refuses files over ``MAX_JSON_BYTES``."""
    path = Path(path)
    name = source or str(path)
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ValueError(f"{name}: {path.stat().st_size} bytes of JSON, over the limit of {MAX_JSON_BYTES}")
    return parse_json(path.read_bytes(), name)


def expect_object(value: Any, source: str) -> dict[str, Any]:
    """``value`` if it is a JSON object, else a ``ValueError`` naming ``source`` and the type found."""
    if not isinstance(value, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(value).__name__} {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
