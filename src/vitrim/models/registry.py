"""Model registry: timm's names, ``create_model`` and ``list_models``."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable
from pathlib import Path
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


def create_model(
    name: str,
    *,
    num_classes: int = 1000,
    img_size: int | tuple[int, int] | None = None,
    checkpoint: str | Path | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build a registered model, optionally loading a checkpoint (vitrim, timm, DeiT, Hugging Face, DynamicViT).

    ``img_size`` defaults to the model's own (224, or 384 for ``*_384``). ``overrides`` use timm's names
    (``embed_dim``, ``depth``, ``num_heads``, ``patch_size``, ``global_pool``, …).
    ``reducer`` (``"tome"``, ``"evit"``, ``"topk"``, or a spec ``"tome:r=13"``) and its options (``r``, ``keep_rate``,
    ``layers``) attach token reducers after building and loading: ``create_model(name, reducer="tome", r=13)``.
    """
    reducer, reducer_kwargs = _pop_reducer(overrides)
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see vitrim.list_models()"
        raise ValueError(f"unknown model {name!r}{hint}")
    if img_size is not None:
        overrides["img_size"] = img_size
    model = _REGISTRY[name](num_classes=num_classes, **overrides)
    if checkpoint is not None:
        from vitrim.checkpoint import load_checkpoint

        load_checkpoint(model, checkpoint)
    if reducer is not None:
        from vitrim.reduce import apply

        apply(model, reducer, **reducer_kwargs)
    return model


def _pop_reducer(overrides: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """Take ``reducer`` and its options out of ``overrides`` (checked before anything is built)."""
    reducer = overrides.pop("reducer", None)
    if reducer is None:
        return None, {}
    from vitrim.reduce import parse_spec, reducer_options

    name, options = parse_spec(reducer) if isinstance(reducer, str) else (reducer, {})
    for key in reducer_options(name):
        if key in overrides:
            options[key] = overrides.pop(key)
    return name, options
