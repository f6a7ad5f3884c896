"""Old import paths kept for one release: a module that moved leaves a shim that hands its names on with a warning.

A shim is its docstring and one line, ``__getattr__ = moved_to(__name__, "vitrim.<new home>")``. A name is looked up
in the new home when it is used (``from vitrim.checkpoint import load_checkpoint``, ``vitrim.hub.fetch``), and each
use warns ``DeprecationWarning`` at the user's line, naming what to write instead. The home is imported only then,
by name: a shim is no dependency of anything (the floors of docs/architecture.md do not count it). ``renamed`` maps
an old name to ``"module:name"`` where it lives now under another name.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_to(old: str, home: str, renamed: dict[str, str] | None = None) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the shim ``old``: names of ``home``, each with a ``DeprecationWarning``."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # import machinery and introspection (__path__, __file__ ...) ask without meaning it
            raise AttributeError(name)
        module_name, _, attribute = (renamed or {}).get(name, f"{home}:{name}").partition(":")
        try:
            value = getattr(importlib.import_module(module_name), attribute)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {home!r})") from None
        warnings.warn(
            f"{old} is deprecated and goes in the next release: use {module_name}.{attribute}",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__
