"""Where each image token of a VLM comes from in the user's ORIGINAL picture: one pixel box per LLM image token.

The index space is :func:`vitrim.vlm.last_selection`'s: the image's tokens in the LLM, in their order. The processor
changed the picture before the tower saw it; each family's box is the token's patch in the processed frame mapped
back through what the processor did, an affine map per axis:

* LLaVA-1.5 (``CLIPImageProcessor`` / ``LlavaImageProcessor``): optional pad to a square (``do_pad``), a resize
  (shortest edge to ``size``, or to ``height × width``), a centre crop to ``crop_size``; the tokens are the
  ``crop / patch`` grid in raster order (with the ``"full"`` feature strategy a first [CLS] token, which has no box);
* LLaVA-NeXT (anyres): token ``tile · N + t`` of the packed map (:meth:`LlavaNextAdapter.token_maps`) is patch
  ``t`` of tile 0 (the base view: the whole picture resized to a square tile) or of grid tile ``tile − 1`` (the
  picture resized into the best pinpoint resolution, centred with padding, cut into square tiles in raster order);
  the newline tokens have no box;
* Qwen2-VL / 2.5-VL / 3-VL: the picture resized to ``image_grid_thw · patch`` (smart_resize), one token per
  ``merge × merge`` patches in raster order;
* PaliGemma (``SiglipImageProcessor``): the picture resized to the processor's ``height × width`` (no crop, the
  aspect ratio not kept), one token per patch;
* Gemma 3 (``Gemma3ImageProcessor``): the same resize; the projector average-pools the p×p patch grid to the
  t×t tokens (``mm_tokens_per_image`` = t², 16×16 in the real checkpoints, each token a k×k cell of patches,
  k = p / t), so a token's box is its cell. A tower method's selection counts the tower's patches, not the pooled
  tokens (``vitrim.vlm.stages.tower``): with ``patches=True`` the boxes are the p×p patches'. Pan-and-scan crops
  (``do_pan_and_scan``) are refused: each crop is an image of its own and the boxes would have to follow them.

A box is ``(x0, y0, x1, y1)`` in original pixels (x right, y down, edges between pixels), clipped to the picture;
a token with no place in it (a newline, [CLS], a patch wholly in padding) has NaNs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

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


# -- LLaVA-1.5 -------------------------------------------------------------------------------------------------------


def _field(size: Any, name: str) -> int | None:
    """A field of transformers' size dicts (a dict or a SizeDict)."""
    value = size.get(name) if isinstance(size, dict) else getattr(size, name, None)
    return None if value is None else int(value)


def resized_size(height: int, width: int, size: Any) -> tuple[int, int]:
    """The (height, width) a processor's resize gives: ``shortest_edge`` keeps the aspect ratio (the long side
    truncated, as transformers' ``get_resize_output_image_size``), ``height``/``width`` is exact."""
    shortest = _field(size, "shortest_edge")
    if shortest is not None and _field(size, "longest_edge") is None:
        short, long = sorted((height, width))
        new_long = int(shortest * long / short)
        return (shortest, new_long) if height <= width else (new_long, shortest)
    target = (_field(size, "height"), _field(size, "width"))
    if target[0] is None or target[1] is None:
        raise ValueError(f"the image processor's size {size!r} is not one vitrim can invert (shortest_edge or h×w)")
    return target[0], target[1]


def crop_axis(original: int, resized: int, crop: int | None, pad: int) -> Affine:
    """One axis of LLaVA-1.5's pad-resize-crop: processed coordinate -> original coordinate.

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


def llava_boxes(image_processor: Any, config: Any, size: tuple[int, int]) -> TokenBoxes:
    """LLaVA-1.5's tokens on a picture of ``size`` (H, W): the patch grid of the processed (cropped) frame."""
    height, width = size
    pad = max(height, width) if getattr(image_processor, "do_pad", False) else None
    pad_h, pad_w = (pad, pad) if pad is not None else (height, width)
    do_resize = getattr(image_processor, "do_resize", True)
    r_h, r_w = resized_size(pad_h, pad_w, image_processor.size) if do_resize else (pad_h, pad_w)
    crop_size = image_processor.crop_size if getattr(image_processor, "do_center_crop", False) else None
    c_h = _field(crop_size, "height") if crop_size is not None else None
    c_w = _field(crop_size, "width") if crop_size is not None else None
    p_h, p_w = c_h or r_h, c_w or r_w
    patch = int(config.vision_config.patch_size)
    if p_h % patch or p_w % patch:
        raise ValueError(f"the processed image {p_h}x{p_w} is not a whole number of {patch}-pixel patches")
    y = crop_axis(height, r_h, c_h, pad_h)
    x = crop_axis(width, r_w, c_w, pad_w)
    rows, cols = p_h // patch, p_w // patch
    boxes = grid_boxes(rows, cols, patch, x, y, size)
    view = torch.zeros(len(boxes), dtype=torch.long)
    if getattr(config, "vision_feature_select_strategy", "default") == "full":  # [CLS] first: no place
        boxes = torch.cat([torch.full((1, 4), math.nan, dtype=torch.float64), boxes])
        view = torch.cat([torch.tensor([NO_VIEW]), view])
    view[boxes[:, 0].isnan()] = NO_VIEW
    return TokenBoxes(boxes, view, ("image",), ((rows, cols),), size)


# -- LLaVA-NeXT ------------------------------------------------------------------------------------------------------


def anyres_layout(size: tuple[int, int], pinpoints: list[list[int]]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The best pinpoint resolution (height, width) for a picture of ``size``, and the size the picture is resized
    to inside it (aspect kept, ``math.ceil`` on the short side, as transformers' ``get_patch_output_size``)."""
    from transformers.image_processing_utils import select_best_resolution

    best_h, best_w = select_best_resolution(size, pinpoints)
    height, width = size
    if best_w / width < best_h / height:
        inner = (min(math.ceil(height * best_w / width), best_h), best_w)
    else:
        inner = (best_h, min(math.ceil(width * best_h / height), best_w))
    return (int(best_h), int(best_w)), (int(inner[0]), int(inner[1]))


def llava_next_boxes(image_processor: Any, config: Any, token_map: Tensor, size: tuple[int, int]) -> TokenBoxes:
    """LLaVA-NeXT's packed tokens (``token_map``: tile · N + t, or −1 for a newline) on a picture of ``size``."""
    height, width = size
    tile = int(config.vision_config.image_size)
    patch = int(config.vision_config.patch_size)
    side = tile // patch
    per_tile = side * side
    pinpoints = [list(p) for p in image_processor.image_grid_pinpoints]
    (best_h, best_w), (inner_h, inner_w) = anyres_layout(size, pinpoints)
    tiles_per_row = best_w // tile
    # the base view: the whole picture resized to the tile (no crop when the sizes agree, as in the hub's configs)
    base = grid_boxes(side, side, patch, Affine(width / tile, 0.0), Affine(height / tile, 0.0), size)
    # the grid tiles: padded canvas -> resized picture (minus the centring padding) -> original
    pad_x, pad_y = (best_w - inner_w) // 2, (best_h - inner_h) // 2
    canvas_x = Affine(width / inner_w, pad_x * width / inner_w)
    canvas_y = Affine(height / inner_h, pad_y * height / inner_h)
    canvas = grid_boxes(best_h // patch, best_w // patch, patch, canvas_x, canvas_y, size)
    numbers = token_map.tolist()
    boxes = torch.full((len(numbers), 4), math.nan, dtype=torch.float64)
    view = torch.full((len(numbers),), NO_VIEW, dtype=torch.long)
    canvas_cols = best_w // patch
    for position, number in enumerate(numbers):
        if number < 0:
            continue  # the image_newline token
        tile_index, token = divmod(number, per_tile)
        row, col = divmod(token, side)
        if tile_index == 0:
            boxes[position], view[position] = base[token], 0
            continue
        tile_row, tile_col = divmod(tile_index - 1, tiles_per_row)
        cell = (tile_row * side + row) * canvas_cols + tile_col * side + col
        boxes[position], view[position] = canvas[cell], 1
    view[boxes[:, 0].isnan()] = NO_VIEW
    grids = ((side, side), (best_h // patch, best_w // patch))
    return TokenBoxes(boxes, view, ("base view", "tiles"), grids, size)


# -- Qwen2-VL / 2.5-VL / 3-VL ----------------------------------------------------------------------------------------


def qwen_boxes(config: Any, grid_thw: Tensor, size: tuple[int, int]) -> TokenBoxes:
    """Qwen's merged tokens on a picture of ``size``; ``grid_thw``: (3,) the image's ``image_grid_thw`` row."""
    height, width = size
    patch = int(config.vision_config.patch_size)
    merge = int(config.vision_config.spatial_merge_size)
    frames, grid_h, grid_w = (int(v) for v in grid_thw.tolist())
    if frames != 1:
        raise ValueError(f"image_grid_thw {grid_thw.tolist()} has {frames} frames; a picture has one")
    resized_h, resized_w = grid_h * patch, grid_w * patch  # the smart_resize size
    x, y = Affine(width / resized_w, 0.0), Affine(height / resized_h, 0.0)
    rows, cols = grid_h // merge, grid_w // merge
    boxes = grid_boxes(rows, cols, patch * merge, x, y, size)
    return TokenBoxes(boxes, torch.zeros(len(boxes), dtype=torch.long), ("image",), ((rows, cols),), size)


# -- PaliGemma, Gemma 3 ----------------------------------------------------------------------------------------------


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


def paligemma_boxes(image_processor: Any, config: Any, size: tuple[int, int]) -> TokenBoxes:
    """PaliGemma's tokens (one per SigLIP patch) on a picture of ``size`` (H, W)."""
    return resized_grid_boxes(image_processor, int(config.vision_config.patch_size), None, size, "image")


def gemma3_boxes(image_processor: Any, config: Any, size: tuple[int, int], patches: bool = False) -> TokenBoxes:
    """Gemma 3's pooled tokens (``patches=True``: the tower's patches) on a picture of ``size`` (H, W)."""
    patch = int(config.vision_config.patch_size)
    if patches:
        return resized_grid_boxes(image_processor, patch, None, size, "patches")
    tokens = int(config.mm_tokens_per_image)
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"mm_tokens_per_image={tokens} is not a square grid of pooled tokens")
    return resized_grid_boxes(image_processor, patch, side, size, "image")


# -- any family ------------------------------------------------------------------------------------------------------


def vlm_token_boxes(
    model: nn.Module, processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
) -> list[TokenBoxes]:
    """Per picture of ``inputs`` (what ``processor`` made of pictures of ``sizes``, each (H, W)), its tokens' boxes.

    model: the transformers VLM (its family and config); processor: its processor (the image processor's resize,
    crop and pinpoints); inputs: the processor's output (``image_grid_thw`` for Qwen, ``image_sizes`` for LLaVA-NeXT);
    stage: the stage whose selection the boxes are for (Gemma 3's tower selects patches: their boxes then).
    """
    from vitrim.vlm.families import find_family
    from vitrim.vlm.families.gemma3 import Gemma3Adapter
    from vitrim.vlm.families.llava import LlavaAdapter
    from vitrim.vlm.families.llava_next import LlavaNextAdapter
    from vitrim.vlm.families.paligemma import PaliGemmaAdapter
    from vitrim.vlm.families.qwen2vl import Qwen2VLAdapter

    family = find_family(model)
    config: Any = model.config
    image_processor = processor.image_processor
    if isinstance(family, LlavaNextAdapter):
        maps = family.token_maps(torch.as_tensor(inputs["image_sizes"]))
        return [llava_next_boxes(image_processor, config, m, s) for m, s in zip(maps, sizes, strict=True)]
    if isinstance(family, LlavaAdapter):
        return [llava_boxes(image_processor, config, s) for s in sizes]
    if isinstance(family, Qwen2VLAdapter):
        grids = torch.as_tensor(inputs["image_grid_thw"])
        return [qwen_boxes(config, g, s) for g, s in zip(grids, sizes, strict=True)]
    if isinstance(family, Gemma3Adapter | PaliGemmaAdapter):
        images = len(inputs["pixel_values"])
        if images != len(sizes):
            raise ValueError(
                f"the processor made {images} images of {len(sizes)} picture(s): Gemma 3's pan-and-scan cut them into "
                "crops, each an image of its own, which vitrim does not map back to the picture; load the processor "
                "with do_pan_and_scan=False"
            )
        if isinstance(family, PaliGemmaAdapter):
            return [paligemma_boxes(image_processor, config, s) for s in sizes]
        return [gemma3_boxes(image_processor, config, s, patches=stage == "tower") for s in sizes]
    raise TypeError(
        "vitrim.viz maps image tokens to pixels for LLaVA-1.5, LLaVA-NeXT, Qwen-VL, Gemma 3 and PaliGemma; not for "
        f"{type(model).__name__}"
    )
