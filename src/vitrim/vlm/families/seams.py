"""What the family adapters read the same way: the model's layout, a forward's input ids, a selection keeping all.

Each ``families/<name>.py`` adapter checks the instance's submodules, finds the ``input_ids`` of the forward passes
it hooks and, where nothing is pruned, records a selection keeping every token; the three do that alike for every
family, so they live here once (this module imports no adapter and no transformers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.method.base import ImageSelection


def inner_model(model: nn.Module, parts: tuple[str, ...], layout: str) -> Any:
    """``model.model`` when it has every attribute of ``parts``; else ``TypeError`` naming what is missing and the
    transformers ``layout`` (e.g. "LlavaForConditionalGeneration") the adapter needs."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, part) for part in parts):
        raise TypeError(
            f"{type(model).__name__} lacks model.{' / '.join(parts)} "
            f"(vitrim.vlm needs transformers >= 5's {layout} layout)"
        )
    return inner


def refuse_meta_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], positional: tuple[str, ...] = ("input_ids", "pixel_values")
) -> None:
    """``ValueError`` naming the first tensor input of a hooked forward call that is on the meta device: vitrim's
    hooks read input values (the image-token positions, the padding, image sizes), which a meta tensor has not.
    ``positional``: the names of the call's first positional arguments (a VLM's forward: input_ids, pixel_values)."""
    names = [positional[i] if i < len(positional) else f"positional argument {i}" for i in range(len(args))]
    named = [*zip(names, args, strict=True), *kwargs.items()]
    for name, value in named:
        if isinstance(value, Tensor) and value.is_meta:
            raise ValueError(
                f"{name} is on the meta device (a tensor without values); vitrim.vlm reads the inputs of a forward "
                "(the image-token positions, the padding): pass tensors on a real device"
            )


def input_ids_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """The ``input_ids`` (B, L) of a hooked forward call; ``ValueError`` when it was given ``inputs_embeds`` or a
    meta-device input (:func:`refuse_meta_inputs`)."""
    refuse_meta_inputs(args, kwargs)
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None:
        raise ValueError("vitrim.vlm needs input_ids (not inputs_embeds) to find the image tokens")
    return input_ids


def prefill_input_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The ``input_ids`` (B, L) of a forward pass that carries images (a prefill), None for one without (a decode
    step: generate drops the images after the prefill; or text alone). generate() encodes the images before its
    first forward and passes them as ``mm_encoder_outputs``, a plain call as ``pixel_values`` (its 2nd argument)."""
    refuse_meta_inputs(args, kwargs)
    pixel_values = kwargs.get("pixel_values", args[1] if len(args) > 1 else None)
    encoded = (kwargs.get("mm_encoder_outputs") or {}).get("image")
    if pixel_values is None and encoded is None:
        return None
    return input_ids_of(args, kwargs)


def keep_all(num_tokens: int, device: torch.device) -> ImageSelection:
    """The selection of an image that keeps its ``num_tokens`` tokens, each its own group (nothing merged)."""
    return ImageSelection.unmerged(torch.arange(num_tokens, device=device))


def write_merged(
    values: Tensor,
    selections: list[ImageSelection],
    transform: Callable[[Tensor], Tensor],
    cls_features: Tensor | None = None,
) -> Tensor | None:
    """``values`` (I, N, …) with each image's merged slots (:meth:`ImageSelection.merged_slots`) set to
    ``transform(merged features)``, and the [CLS] carrier slot of an image whose selection hands on its [CLS] set to
    ``cls_features[image]`` ((I, …) as ``values`` holds a token): a copy, or None when nothing was written."""
    written = None
    for image, selection in enumerate(selections):
        if selection.cls:
            if cls_features is None:
                raise ValueError("the selection hands the LLM the tower's [CLS], which this family did not capture")
            written = values.clone() if written is None else written
            written[image, selection.cls_carrier()] = cls_features[image].to(values.dtype)
        if selection.merged is None:
            continue
        slots = selection.merged_slots()
        if not len(slots):
            continue
        written = values.clone() if written is None else written
        merged = transform(selection.merged[slots.to(selection.merged.device)])
        written[image, selection.kept[slots]] = merged.to(values.dtype)
    return written
