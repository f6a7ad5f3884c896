"""Model registry: timm's names, ``register_model``, ``build_model`` and ``list_models``."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable
from typing import Any

from torch import nn

ModelFactory = Callable[..., nn.Module]
_REGISTRY: dict[str, ModelFactory] = {}


def register_model(fn: ModelFactory) -> ModelFactory:
    """Decorator: register ``fn(**overrides) -> nn.Module`` under its function name."""
    if fn.__name__ in _REGISTRY:
        raise ValueError(f"model {fn.__name__!r} is already registered")
    _REGISTRY[fn.__name__] = fn
    return fn


def list_models(pattern: str = "*") -> list[str]:
    """Sorted names of registered models matching a shell-style ``pattern`` (e.g. ``"deit_*"``)."""
    return sorted(name for name in _REGISTRY if fnmatch.fnmatch(name, pattern))


def build_model(name: str, **overrides: Any) -> nn.Module:
    """Build the registered model ``name`` with ``overrides`` (timm's names); close matches for an unknown name."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see vitrim.list_models()"
        raise ValueError(f"unknown model {name!r}{hint}")
    return _REGISTRY[name](**overrides)
