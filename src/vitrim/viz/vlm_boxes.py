"""Where each image token of a VLM comes from in the user's ORIGINAL picture: one pixel box per LLM image token.

The index space is :func:`vitrim.vlm.last_selection`'s: the image's tokens in the LLM, in their order. How a
family's processor changed the picture, and so where its tokens lie, is that family's fact and lives in its file
(:meth:`FamilyAdapter.token_boxes <vitrim.vlm.families.contract.FamilyAdapter.token_boxes>`: LLaVA-1.5's
pad-resize-crop, LLaVA-NeXT's anyres tiles, Qwen's smart_resize, Gemma 3's pooled cells ...); the maths they share
and :class:`TokenBoxes` are :mod:`vitrim.vlm.boxes`, handed on here. A new family adds nothing to this file.

A box is ``(x0, y0, x1, y1)`` in original pixels (x right, y down, edges between pixels), clipped to the picture;
a token with no place in it (a newline, [CLS], a patch wholly in padding) has NaNs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vitrim.moved import moved_names
from vitrim.vlm.boxes import (
    NO_VIEW,
    Affine,
    TokenBoxes,
    crop_axis,
    grid_boxes,
    resized_grid_boxes,
    resized_size,
)
from vitrim.vlm.families import ADAPTERS, FamilyAdapter, find_family


def vlm_token_boxes(
    model: nn.Module, processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
) -> list[TokenBoxes]:
    """Per picture of ``inputs`` (what ``processor`` made of pictures of ``sizes``, each (H, W)), its tokens' boxes.

    model: the transformers VLM (its family and config); processor: its processor (the image processor's resize,
    crop and pinpoints); inputs: the processor's output (``image_grid_thw`` for Qwen, ``image_sizes`` for LLaVA-NeXT);
    stage: the stage whose selection the boxes are for (Gemma 3's tower selects patches: their boxes then).
    A family that does not map its tokens raises ``TypeError`` naming the model's class.
    """
    family = find_family(model)
    if type(family).token_boxes is FamilyAdapter.token_boxes:  # a family that does not map its tokens
        mapped = [adapter.traits.title for adapter in ADAPTERS if adapter.token_boxes is not FamilyAdapter.token_boxes]
        raise TypeError(f"vitrim maps image tokens to pixels for {', '.join(mapped)}; not for {type(model).__name__}")
    return family.token_boxes(processor.image_processor, inputs, sizes, stage)


# each family's box function lived here before issue 49 and is its family's now: the old names are answered for one
# release by the table of old paths (vitrim.moved), each looked up in its family's module when used
__getattr__ = moved_names(__name__)

__all__ = [
    "NO_VIEW",
    "Affine",
    "TokenBoxes",
    "crop_axis",
    "grid_boxes",
    "resized_grid_boxes",
    "resized_size",
    "vlm_token_boxes",
]
