"""The pixel-box maths every family shares: where an LLM image token comes from in the user's ORIGINAL picture.

A family's adapter maps its tokens with these pieces (:meth:`FamilyAdapter.token_boxes
<vitrim.vlm.families.contract.FamilyAdapter.token_boxes>`): the processor changed the picture before the tower saw
it, and a token's box is its patch (or pooled cell) in the processed frame mapped back through what the processor
did, an :class:`Affine` map per axis. A box is ``(x0, y0, x1, y1)`` in original pixels (x right, y down, edges
between pixels), clipped to the picture; a token with no place in it (a newline, [CLS], a patch wholly in padding)
has NaNs.

Nothing here imports transformers: the processors are read through their attributes (``size``, ``crop_size``,
``do_resize``, ...), so ``import vitrim.vlm`` stays free of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

NO_VIEW = -1


@dataclass(frozen=True)
class TokenBoxes:
    """One picture's LLM image tokens located in it.

    boxes: (T, 4) float64   x0, y0, x1, y1 in original pixels; NaN for a token with no place in the picture
    view: (T,) long          which view of the picture the token sees (index into ``views``), NO_VIEW for none
    views: the views' names ("image"; LLaVA-NeXT: "base view", "tiles")
    grids: per view, (rows, cols) of its token grid (LLaVA-NeXT's tiles: over the whole tile grid)
    size: (height, width) of the original picture
    """

    boxes: Tensor
    view: Tensor
    views: tuple[str, ...]
    grids: tuple[tuple[int, int], ...]
    size: tuple[int, int]


@dataclass(frozen=True)
class Affine:
    """Processed-frame coordinate -> original coordinate on one axis: ``original = processed · scale − shift``."""

    scale: float
    shift: float

    def __call__(self, value: Tensor) -> Tensor:
        return value * self.scale - self.shift


def grid_boxes(rows: int, cols: int, cell: float, x: Affine, y: Affine, size: tuple[int, int]) -> Tensor:
    """(rows·cols, 4): the boxes of a raster grid of square cells of ``cell`` processed pixels, in original pixels,
    clipped to the picture of ``size`` (H, W); a box left with no area is NaN."""
    r, c = torch.meshgrid(
        torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64), indexing="ij"
    )
    r, c = r.reshape(-1), c.reshape(-1)
    boxes = torch.stack([x(c * cell), y(r * cell), x((c + 1) * cell), y((r + 1) * cell)], dim=1)
    height, width = size
    boxes[:, 0::2] = boxes[:, 0::2].clamp(0, width)
    boxes[:, 1::2] = boxes[:, 1::2].clamp(0, height)
    empty = (boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1])
    boxes[empty] = math.nan
    return boxes


def size_field(size: Any, name: str) -> int | None:
    """A field of transformers' size dicts (a dict or a SizeDict)."""
    value = size.get(name) if isinstance(size, dict) else getattr(size, name, None)
    return None if value is None else int(value)


def resized_size(height: int, width: int, size: Any) -> tuple[int, int]:
    """The (height, width) a processor's resize gives: ``shortest_edge`` keeps the aspect ratio (the long side
    truncated, as transformers' ``get_resize_output_image_size``), ``height``/``width`` is exact."""
    shortest = size_field(size, "shortest_edge")
    if shortest is not None and size_field(size, "longest_edge") is None:
        short, long = sorted((height, width))
        new_long = int(shortest * long / short)
        return (shortest, new_long) if height <= width else (new_long, shortest)
    target = (size_field(size, "height"), size_field(size, "width"))
    if target[0] is None or target[1] is None:
        raise ValueError(f"the image processor's size {size!r} is not one vitrim can invert (shortest_edge or h×w)")
    return target[0], target[1]


def crop_axis(original: int, resized: int, crop: int | None, pad: int) -> Affine:
    """One axis of a pad-resize-crop (LLaVA-1.5's processor): processed coordinate -> original coordinate.

    original: the picture's length; pad: the square side it was padded to (= original without ``do_pad``);
    resized: the length after the resize; crop: the centre crop's length (None: no crop). The crop starts at
    ``int((resized − crop) / 2)`` (transformers' centre crop; a crop longer than the image pads it by
    ``(crop − resized) // 2`` first), the padding at ``(pad − original) // 2``.
    """
    if crop is None:
        start = 0.0
    elif crop <= resized:
        start = float(int((resized - crop) / 2.0))
    else:
        start = -float((crop - resized) // 2)
    scale = pad / resized
    return Affine(scale=scale, shift=-start * scale + (pad - original) // 2)


def resized_grid_boxes(
    image_processor: Any, patch: int, cells: int | None, size: tuple[int, int], view: str
) -> TokenBoxes:
    """A picture of ``size`` (H, W) resized to the processor's ``height × width`` (no crop, no padding) and cut
    into ``patch``-pixel patches; ``cells``: tokens per side when the patches are pooled into a ``cells × cells``
    grid (Gemma 3's projector), None for one token per patch."""
    height, width = size
    do_resize = getattr(image_processor, "do_resize", True)
    r_h, r_w = resized_size(height, width, image_processor.size) if do_resize else (height, width)
    if r_h % patch or r_w % patch:
        raise ValueError(f"the processed image {r_h}x{r_w} is not a whole number of {patch}-pixel patches")
    rows, cols = r_h // patch, r_w // patch
    cell = float(patch)
    if cells is not None:
        if rows != cols or rows % cells:
            raise ValueError(f"a {rows}x{cols} patch grid does not pool evenly to {cells}x{cells} tokens")
        cell, rows, cols = float(r_h // cells), cells, cells
    boxes = grid_boxes(rows, cols, cell, Affine(width / r_w, 0.0), Affine(height / r_h, 0.0), size)
    return TokenBoxes(boxes, torch.zeros(len(boxes), dtype=torch.long), (view,), ((rows, cols),), size)


def one_image_per_picture(inputs: dict[str, Any], sizes: list[tuple[int, int]], why: str) -> None:
    """Refuse ``inputs`` whose processor made more (or fewer) images than the pictures of ``sizes``; ``why``: the
    family's reason and the way out, ending the one-line error."""
    images = len(inputs["pixel_values"])
    if images != len(sizes):
        raise ValueError(f"the processor made {images} images of {len(sizes)} picture(s): {why}")
