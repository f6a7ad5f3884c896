"""Old import paths kept for one release: a module that moved leaves a shim that hands its names on with a warning.

A shim is three lines: its docstring, ``import vitrim.<new home> as _home`` and ``__getattr__ = moved_to(__name__,
_home)``. A name is looked up in the new home when it is used (``from vitrim.checkpoint import load_checkpoint``,
``vitrim.hub.fetch``), and each use warns ``DeprecationWarning`` at the user's line, naming the import to write.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any


def moved_to(old: str, home: ModuleType) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the shim ``old``: names of ``home``, each with a ``DeprecationWarning``."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # import machinery and introspection (__path__, __file__ ...) ask without meaning it
            raise AttributeError(name)
        try:
            value = getattr(home, name)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {home.__name__!r})") from None
        warnings.warn(
            f"{old} is deprecated and goes in the next release: use {home.__name__}.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__
