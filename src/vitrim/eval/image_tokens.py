"""How many image (and video) tokens of each sample entered the LLM at prefill, measured at the LLM's door.

A forward pre-hook on the model's language model, installed after ``vitrim.vlm.apply`` (so it runs after the
methods' own hooks there, on what they hand the LLM), reads the first call of each ``generate`` (the prefill): the
sequence the LLM runs and its attention mask. Per row, the tokens that entered are the 2-D padding mask's ones (the
whole row when there is no mask); where the LLM is handed 4-D masks instead (Gemma 3's, one per layer type, of
which the full-attention one; a Qwen batch of videos a method shortened unevenly), the keys the last query attends.
Less the row's text tokens, which no method drops, they are the image and video tokens that entered.
Counted this way, a pre-LLM method's cut, a [CLS] a method hands on (VisionZip's) and a method that keeps every
slot but masks the dropped ones (``positions="original"``) are all seen as the LLM saw them, with no knowledge of
how the method did it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def language_model(model: nn.Module) -> nn.Module:
    """The decoder a transformers VLM runs its prompt through (``model.model.language_model``)."""
    inner = getattr(model, "model", None)
    found = getattr(inner, "language_model", None) or getattr(model, "language_model", None)
    if not isinstance(found, nn.Module):
        raise ValueError(f"{type(model).__name__} has no language_model to count the image tokens entering it")
    return found


class PrefillDoor:
    """Counts, per row, the tokens the LLM's prefill runs on (``rows``: None before a prefill; ``reset`` before each
    ``generate``)."""

    def __init__(self, model: nn.Module) -> None:
        self.rows: list[int] | None = None
        self.handle = language_model(model).register_forward_pre_hook(self._enter, with_kwargs=True)

    def reset(self) -> None:
        self.rows = None

    def remove(self) -> None:
        self.handle.remove()

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.rows is not None:  # a decoding step: the prefill was counted
            return
        embeds = kwargs.get("inputs_embeds")
        if embeds is None and args and isinstance(args[0], Tensor):
            embeds = args[0]
        if not isinstance(embeds, Tensor) or embeds.ndim != 3:
            raise ValueError(f"{type(module).__name__}: expected inputs_embeds (B, L, D) at the LLM's prefill")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):  # masks per layer type (Gemma 3): the full-attention layers' sees every token
            mask = mask.get("full_attention")
        if isinstance(mask, Tensor) and mask.ndim == 2 and mask.shape == embeds.shape[:2]:
            self.rows = [int(n) for n in mask.to(torch.long).sum(-1)]
        elif isinstance(mask, Tensor) and mask.ndim == 4 and mask.shape[-1] == embeds.shape[1]:
            self.rows = [int(n) for n in _attended_by_last(mask)]
        elif mask is None:  # no padding mask: every position of every row runs
            self.rows = [embeds.shape[1]] * embeds.shape[0]
        else:
            raise ValueError(
                f"{type(module).__name__}: an attention mask of shape {tuple(mask.shape)} at the LLM's prefill; "
                "expected (B, L) or (B, 1, L, L)"
            )


def _attended_by_last(mask: Tensor) -> Tensor:
    """Per row of a (B, 1 or H, L, L) mask (True or 0.0 where attended, the masked-out float minimum elsewhere): the
    keys the last query attends. Prompts are padded on the left, so the last position is a real token, and in a
    full causal layer it attends every real token (a method that masks a dropped token's key drops it here too)."""
    last = mask[:, 0, -1, :]
    attended = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    return attended.to(torch.long).sum(-1)


def image_token_id(model: nn.Module) -> int:
    """The id of the image placeholder token in the prompt (the config's ``image_token_id`` / ``_index``)."""
    config = model.config
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(model).__name__}'s config names no image token id")


def video_token_id(model: nn.Module) -> int | None:
    """The id of the video placeholder token (Qwen2/2.5/3-VL's ``video_token_id``), None for a model without video."""
    value = getattr(model.config, "video_token_id", None)
    return value if isinstance(value, int) else None


def prompt_counts(
    input_ids: Tensor, attention_mask: Tensor | None, image_id: int, video_id: int | None = None
) -> tuple[list[int], list[int], list[int]]:
    """Per row of the (B, L) prompt: its image tokens, its video tokens and its text tokens (padding excluded; a
    Qwen3-VL video's timestamps and vision start/end tokens are text)."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    image = (input_ids == image_id) & real
    video = (input_ids == video_id) & real if video_id is not None else torch.zeros_like(image)
    text = real & ~image & ~video
    return [int(n) for n in image.sum(-1)], [int(n) for n in video.sum(-1)], [int(n) for n in text.sum(-1)]
