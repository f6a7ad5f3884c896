"""What a hooked forward call holds, read the same way for every family and stage: the model's layout, a call's
``input_ids`` (a prefill's, or none for a decode step), and a refusal of inputs on the meta device (this module
imports no family and no transformers).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn


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
