"""The reducer registry: ``@register("name")`` on a :class:`~vitrim.reduce.base.Reducer` subclass makes it usable by
name in ``vitrim.reduce.apply``, ``create_model(..., reducer="name")`` and the CLI."""

from __future__ import annotations

import difflib
from collections.abc import Callable

from vitrim.reduce.base import Reducer

_REDUCERS: dict[str, type[Reducer]] = {}


def register(name: str) -> Callable[[type[Reducer]], type[Reducer]]:
    """Class decorator: register a Reducer subclass under ``name``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"reducer name must be an identifier like 'tome', got {name!r}")

    def decorate(cls: type[Reducer]) -> type[Reducer]:
        if not (isinstance(cls, type) and issubclass(cls, Reducer)):
            raise TypeError(f"@register({name!r}) decorates a vitrim.reduce.Reducer subclass, got {cls!r}")
        if name in _REDUCERS and _REDUCERS[name] is not cls:
            raise ValueError(f"reducer {name!r} is already registered by {_REDUCERS[name].__qualname__}")
        cls.name = name
        _REDUCERS[name] = cls
        return cls

    return decorate


def list_reducers() -> list[str]:
    """Names of the registered reducers, sorted."""
    return sorted(_REDUCERS)


def get_reducer(name: object) -> type[Reducer]:
    """The class registered as ``name``; a ValueError with close matches for an unknown name."""
    if not isinstance(name, str) or name not in _REDUCERS:
        close = difflib.get_close_matches(str(name), list(_REDUCERS), n=2)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(f"unknown reducer {name!r}; expected one of {list_reducers()}{hint}")
    return _REDUCERS[name]
