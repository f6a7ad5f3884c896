"""Model registry: timm's names, ``register_model``, ``build_model`` and ``list_models``."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable
from typing import Any, overload

from torch import nn

from vitrim.models.data_config import VIT, DataConfig

ModelFactory = Callable[..., nn.Module]
_REGISTRY: dict[str, ModelFactory] = {}
_DATA: dict[str, DataConfig] = {}


@overload
def register_model(fn: ModelFactory) -> ModelFactory: ...
@overload
def register_model(*, data: DataConfig) -> Callable[[ModelFactory], ModelFactory]: ...
def register_model(
    fn: ModelFactory | None = None, *, data: DataConfig = VIT
) -> ModelFactory | Callable[[ModelFactory], ModelFactory]:
    """Decorator: register ``fn(**overrides) -> nn.Module`` under its function name, with the data config its
    weights expect (``@register_model(data=CLIP)``; default: timm's ViT one)."""

    def decorate(fn: ModelFactory) -> ModelFactory:
        if fn.__name__ in _REGISTRY:
            raise ValueError(f"model {fn.__name__!r} is already registered")
        _REGISTRY[fn.__name__] = fn
        _DATA[fn.__name__] = data
        return fn

    return decorate if fn is None else decorate(fn)


def list_models(pattern: str = "*") -> list[str]:
    """Sorted names of registered models matching a shell-style ``pattern`` (e.g. ``"deit_*"``)."""
    return sorted(name for name in _REGISTRY if fnmatch.fnmatch(name, pattern))


def check_registered(name: str) -> None:
    """A ValueError naming close matches when ``name`` is not a registered model."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see vitrim.list_models()"
        raise ValueError(f"unknown model {name!r}{hint}")


def build_model(name: str, **overrides: Any) -> nn.Module:
    """Build the registered model ``name`` with ``overrides`` (timm's names); close matches for an unknown name."""
    check_registered(name)
    model = _REGISTRY[name](**overrides)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "img_size"):
        model.data_config = _DATA[name].for_input(config.in_chans, config.img_size)  # type: ignore[assignment]
    return model
