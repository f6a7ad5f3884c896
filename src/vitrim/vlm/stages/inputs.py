"""What a hooked forward call holds, read the same way for every family and stage: the model's layout, a call's
``input_ids`` (a prefill's, or none for a decode step), the cache it was given, and the refusals of inputs vitrim
cannot read: on the meta device, an ``attention_mask`` or ``labels`` of another shape than ``input_ids`` (this module
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


def cache_of(kwargs: dict[str, Any]) -> Any:
    """The cache a forward was given (transformers >= 5.20 call it ``cache``, earlier 5.x ``past_key_values``)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def check_mask_and_labels(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``ValueError`` naming the argument, its shape and the shape expected, for an ``attention_mask`` or ``labels``
    of a VLM's forward that does not fit its ``input_ids`` (B, L).

    The stages read both column by column against ``input_ids``: the padding of each column (the in-LLM drop, the
    shortened sequence), the label of each kept column (a pre-LLM stage that shortens the input computes the loss
    on the kept columns). A mask one column short or a 3-D mask failed deep inside them, and labels of another
    batch returned a loss where the unmodified model raises. Expected: ``attention_mask`` (B, past + L), the 2-D
    padding mask (past: the tokens already in the cache; at a decode step its batch only is checked, since after a
    shortened prefill the cache holds fewer tokens than the mask has columns), or a 4-D mask the caller built;
    ``labels`` (B, L)."""
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
        return  # inputs_embeds: refused where the stages need input_ids
    batch, length = input_ids.shape
    cache = cache_of(kwargs)
    past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.ndim != 4:
        fits = mask.ndim == 2 and mask.shape[0] == batch and (past > 0 or mask.shape[1] == length)
        if not fits:
            columns = f"{length}" if past == 0 else f"{past} cached + {length}"
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)}; expected ({batch}, {past + length}): the 2-D padding "
                f"mask of input_ids {(batch, length)}, one column per token ({columns})"
            )
    labels = kwargs.get("labels")
    if isinstance(labels, Tensor) and tuple(labels.shape) != (batch, length):
        raise ValueError(
            f"labels has shape {tuple(labels.shape)}; expected ({batch}, {length}), one label per token of input_ids "
            f"{(batch, length)} (-100 where no loss is taken)"
        )


class InputCheck:
    """A forward pre-hook on a VLM (its outermost module) that runs :func:`check_mask_and_labels` before any stage
    reads the call; ``remove()`` takes it off."""

    def __init__(self, model: nn.Module) -> None:
        self._handle = model.register_forward_pre_hook(
            lambda module, args, kwargs: check_mask_and_labels(args, kwargs), with_kwargs=True
        )

    def remove(self) -> None:
        self._handle.remove()
