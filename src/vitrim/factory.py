"""``vitrim.create_model``: a registered model, its weights and its token reducers, composed in one call.

It only composes: the registry builds (:mod:`vitrim.models`), :mod:`vitrim.weights` brings the weights (a file, a
hub repo, timm's pretrained weights by name), :mod:`vitrim.reduce` attaches the reducers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vitrim import reduce
from vitrim.models.registry import build_model
from vitrim.weights import hub
from vitrim.weights.checkpoint import load_checkpoint
from vitrim.weights.pretrained import from_timm_name, load_model, read_weights
from vitrim.weights.tags import split_tag


def create_model(
    name: str,
    *,
    pretrained: bool = False,
    num_classes: int | None = None,
    img_size: int | tuple[int, int] | None = None,
    checkpoint: str | Path | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build a registered model, optionally with pretrained weights or a checkpoint (vitrim, timm, DeiT, Hugging
    Face, DynamicViT; a path or ``"hf-hub:ORG/NAME"``).

    ``name`` is timm's: ``"vit_base_patch16_224"``, or with a pretrained tag ``"vit_base_patch16_224.augreg2_in21k_
    ft_in1k"``. ``pretrained=True`` reads the weights of timm's hub repo ``timm/<name>.<tag>`` through
    huggingface_hub (its cache; ``HF_HUB_OFFLINE=1`` reads the cache only); without a tag, the architecture's default
    tag (timm's). The model then has the weights' data config (``model.data_config``) and, unless ``num_classes``
    says otherwise, their classes (another count: a fresh head, as timm fine-tunes). ``"hf-hub:ORG/NAME"`` as the
    name is ``vitrim.load_model`` of that repo, with reducers attached.

    ``img_size`` defaults to the model's own (224, or 384 for ``*_384``); another one resamples the position
    embedding. ``overrides`` use timm's names (``embed_dim``, ``depth``, ``num_heads``, ``patch_size``,
    ``global_pool``, …). ``reducer`` (a name from ``vitrim.reduce.list_reducers()``, or a spec ``"tome:r=13"``) and its
    options (``r``, ``keep_rate``, ``keep_ratio``, ``layers``, …) attach token reducers: ``create_model(name,
    reducer="tome", r=13)``. They are attached before the weights load, so a learned reducer's weights (DynamicViT's
    ``score_predictor.*``) load from a checkpoint that has them and stay fresh when it does not.
    """
    if not isinstance(name, str):  # a path object, a number, a list: before any lookup reads it as a name
        raise TypeError(
            f"name must be a model name or 'hf-hub:ORG/NAME' (a str), got {type(name).__name__} {name!r:.80}"
        )
    reducer, reducer_options = _pop_reducer(overrides)
    if not isinstance(pretrained, bool):
        raise TypeError(f"pretrained must be a bool, got {pretrained!r}")
    if pretrained and checkpoint is not None:
        raise ValueError("pass pretrained=True or checkpoint=..., not both: both name the weights to load")
    if img_size is not None:
        overrides["img_size"] = img_size
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    if hub.is_hub_name(name):
        if checkpoint is not None:
            raise ValueError(f"model {name!r} is a hub repo with its own weights; checkpoint=... does not apply")
        model = load_model(name, **overrides)
    elif pretrained:
        model = from_timm_name(name, overrides, reducer, reducer_options)
        reducer = None  # attached before the weights loaded
    else:
        model = build_model(split_tag(name)[0], **{"num_classes": 1000, **overrides})
    if reducer is not None:
        reduce.apply(model, reducer, **reducer_options)
    if checkpoint is not None:
        load_checkpoint(
            model, read_weights(_hub_weights(str(checkpoint))) if hub.is_hub_name(checkpoint) else checkpoint
        )
    return model


def _hub_weights(name: str) -> Path:
    repo_id, revision = hub.parse_hub_name(name)
    return hub.fetch(repo_id, revision, need_config=False).weights


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
