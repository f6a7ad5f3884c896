"""``vitrim.create_model``: a registered model, its checkpoint and its token reducers, composed in one call.

This is the one place where the three floors meet (models build, checkpoint loads, reduce attaches), so none of
them has to import another against the layering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vitrim import reduce
from vitrim.checkpoint import load_checkpoint
from vitrim.models.registry import build_model


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
    ``reducer`` (a name from ``vitrim.reduce.list_reducers()``, or a spec ``"tome:r=13"``) and its options (``r``,
    ``keep_rate``, ``keep_ratio``, ``layers``, …) attach token reducers: ``create_model(name, reducer="tome", r=13)``.
    They are attached before the checkpoint loads, so a learned reducer's weights (DynamicViT's
    ``score_predictor.*``) load from it when it has them and stay fresh when it does not.
    """
    reducer, reducer_options = _pop_reducer(overrides)
    if img_size is not None:
        overrides["img_size"] = img_size
    model = build_model(name, num_classes=num_classes, **overrides)
    if reducer is not None:
        reduce.apply(model, reducer, **reducer_options)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model


def _pop_reducer(overrides: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """Take ``reducer`` and its options out of ``overrides`` (checked before anything is built)."""
    reducer = overrides.pop("reducer", None)
    if reducer is None:
        return None, {}
    name, options = reduce.parse_spec(reducer) if isinstance(reducer, str) else (reducer, {})
    for key in reduce.reducer_options(name):
        if key in overrides:
            options[key] = overrides.pop(key)
    return name, options
