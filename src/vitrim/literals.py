"""Read small ``key=value`` specs from the command line (``"tome:r=13"``, ``--set depth=4``) without running code."""

from __future__ import annotations

import ast
from typing import Any


def split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: ``"a=1,b=(2,3),c='x,y'" -> ["a=1", "b=(2,3)", "c='x,y'"]``."""
    parts, depth, start, quote = [], 0, 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_value(text: str) -> Any:
    """A Python literal (int, float, tuple, bool, None, quoted string) when it is one, else the string itself.

    Read with :func:`ast.literal_eval`, which runs no code; a list becomes a tuple (configs are frozen).
    """
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()
    return tuple(value) if isinstance(value, list) else value


def parse_assignments(text: str, option: str, form: str = "key=value[,key=value...]") -> dict[str, Any]:
    """``"embed_dim=32,depth=2"`` -> ``{"embed_dim": 32, "depth": 2}``: the one ``--set`` grammar.

    Errors name ``option`` and show ``form``, the way the option is written in its ``--help`` (its metavar).
    Values are read by :func:`parse_value`; commas inside brackets and quotes do not split.
    """
    if not text.strip():  # an empty --set would silently drop the overrides a command line meant to give
        raise ValueError(f"{option} expects {form}, got an empty value {text!r}")
    values: dict[str, Any] = {}
    for part in split_top_level(text):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier() or not raw.strip():
            raise ValueError(f"{option} expects {form} with a Python name as key, got {text!r} (bad part {part!r})")
        values[key] = parse_value(raw.strip())
    return values
