"""The image tokens a VLM method let into the LLM, drawn on the user's own picture.

Each LLM image token is a pixel box of the original picture (:mod:`vitrim.viz.vlm_boxes`); the selection is
:func:`vitrim.vlm.last_selection`'s ``groups``: one group per token that entered the LLM, the token indices it
stands for. A token in no group was dropped and is washed towards white; a token that entered alone keeps its
pixels; the tokens of a merged group (several indices in one LLM token) are tinted and outlined in the group's
colour; pixels no token of the view covers (LLaVA-1.5's crop cut them off) are greyed. LLaVA-NeXT's base view and
tiles see the picture twice: one panel each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from vitrim.viz.maps import new_figure
from vitrim.viz.vlm_boxes import TokenBoxes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DROPPED = -1


def token_groups(boxes: TokenBoxes, groups: Sequence[Tensor]) -> Tensor:
    """(T,) long: per image token, the LLM token (index into ``groups``) it entered in, or DROPPED.

    ``ValueError`` when a group names a token outside 0 … T−1 or two groups name one token."""
    count = len(boxes.boxes)
    entered = torch.full((count,), DROPPED, dtype=torch.long)
    for number, group in enumerate(groups):
        members = torch.as_tensor(group).reshape(-1).long().cpu()
        if members.numel() and (members.min() < 0 or members.max() >= count):
            raise ValueError(f"group {number} names token {members.tolist()}, outside the picture's {count} tokens")
        if (entered[members] != DROPPED).any():
            raise ValueError(f"group {number} names a token another group already holds: {members.tolist()}")
        entered[members] = number
    return entered


def picture_array(image: Any) -> np.ndarray:
    """A PIL image, (H, W, 3) uint8 / float array or (3, H, W) tensor in [0, 1] -> (H, W, 3) float32 in [0, 1]."""
    if isinstance(image, Tensor):
        array = image.detach().float().cpu().permute(1, 2, 0).numpy()
    else:
        array = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
        array = array.astype(np.float32) / 255.0 if array.dtype == np.uint8 else array.astype(np.float32)
    if array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"image must be RGB (H, W, 3), got shape {array.shape}")
    return np.clip(array, 0.0, 1.0)


def _pixels(box: Tensor) -> tuple[slice, slice]:
    x0, y0, x1, y1 = (round(float(v)) for v in box)
    return slice(y0, max(y1, y0 + 1)), slice(x0, max(x1, x0 + 1))


def group_colour(number: int) -> np.ndarray:
    """A distinct RGB colour per merged group (matplotlib's tab20, cycled)."""
    from matplotlib import colormaps

    return np.asarray(colormaps["tab20"](number % 20)[:3], dtype=np.float32)


def render_vlm_kept(
    image: Any, boxes: TokenBoxes, groups: Sequence[Tensor], wash: float = 0.7, tint: float = 0.45
) -> list[np.ndarray]:
    """Per view of ``boxes``, (H, W, 3) float32 in [0, 1]: dropped tokens' pixels washed towards white by ``wash``,
    merged groups' pixels blended with their colour by ``tint``, tokens that entered alone untouched, pixels of no
    token blended half-way to mid grey."""
    if not 0.0 <= wash <= 1.0 or not 0.0 <= tint <= 1.0:
        raise ValueError(f"wash and tint must be in [0, 1], got {wash!r} and {tint!r}")
    rgb = picture_array(image)
    if rgb.shape[:2] != boxes.size:
        raise ValueError(
            f"the image is {rgb.shape[0]}x{rgb.shape[1]} but the boxes are for {boxes.size[0]}x{boxes.size[1]}"
        )
    entered = token_groups(boxes, groups)
    sizes = torch.bincount(entered[entered != DROPPED], minlength=len(groups))
    panels = []
    for view in range(len(boxes.views)):
        panel = 0.5 * 0.5 + 0.5 * rgb  # what no token covers stays grey
        for token in torch.nonzero(boxes.view == view).reshape(-1).tolist():
            rows, cols = _pixels(boxes.boxes[token])
            number = int(entered[token])
            if number == DROPPED:
                panel[rows, cols] = wash + (1.0 - wash) * rgb[rows, cols]
            elif sizes[number] == 1:
                panel[rows, cols] = rgb[rows, cols]
            elif sizes[number] > 1:
                panel[rows, cols] = tint * group_colour(number) + (1.0 - tint) * rgb[rows, cols]
        panels.append(panel.astype(np.float32))
    return panels


def plot_vlm_kept(image: Any, boxes: TokenBoxes, groups: Sequence[Tensor], *, title: str = "") -> Figure:
    """The picture with its tokens as the LLM received them (one panel per view, see the module docstring).

    image: the ORIGINAL picture (PIL image, (H, W, 3) array or (3, H, W) tensor in [0, 1]); boxes: its tokens'
    boxes (:func:`vitrim.viz.vlm_token_boxes`); groups: ``vitrim.vlm.last_selection(model, groups=True)[i]``.
    """
    from matplotlib.patches import Rectangle

    panels = render_vlm_kept(image, boxes, groups)
    entered = token_groups(boxes, groups)
    height, width = boxes.size
    panel_width = 4.0 * min(2.0, max(0.5, width / height))
    fig = new_figure((max(6.5, panel_width * len(panels)), 4.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    placed = boxes.view != -1
    merged = sum(1 for g in groups if torch.as_tensor(g).numel() > 1)
    for view, (ax, panel) in enumerate(zip(axes, panels, strict=True)):
        ax.imshow(panel, interpolation="nearest", extent=(0, width, height, 0))
        here = boxes.view == view
        for token in torch.nonzero(here & (entered != DROPPED)).reshape(-1).tolist():
            number = int(entered[token])
            if torch.as_tensor(groups[number]).numel() > 1:
                x0, y0, x1, y1 = (float(v) for v in boxes.boxes[token])
                colour = tuple(group_colour(number).tolist())
                ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor=colour, linewidth=0.8))
        kept = int((here & (entered != DROPPED)).sum())
        rows, cols = boxes.grids[view]
        ax.set_title(f"{boxes.views[view]} ({rows}x{cols}): {kept} of {int(here.sum())} tokens in", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    total = int(placed.sum())
    summary = f"{len(groups)} LLM tokens stand for {int((entered != DROPPED).sum())} of {len(entered)} image tokens"
    summary += f" ({total} on the picture); {merged} merged" if merged else f" ({total} on the picture)"
    fig.suptitle(f"{title}\n{summary}" if title else summary, fontsize=10)
    return fig
