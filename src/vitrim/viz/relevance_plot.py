"""The relevance picture: image | relevance on the patch grid | overlay | (reducing models) what was kept or merged.

The last panel draws the final ``patch_to_token`` map (:class:`vitrim.viz.relevance.RelevanceMap`): a patch that was
dropped is washed out towards white, patches merged into one token share a colour (one per token, from a
qualitative palette), and a patch still its own token shows as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from vitrim.viz.maps import colormap, finish_panels, new_figure, to_rgb

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def token_layout(
    patch_to_token: Tensor, grid: tuple[int, int], wash: float = 0.75
) -> tuple[np.ndarray, dict[str, int]]:
    """(gh, gw, 4) RGBA overlay of one sample's final ``patch_to_token`` (P,), and counts of kept/merged/dropped.

    Dropped patches: white at alpha ``wash``; patches of a token standing for several: that token's colour at alpha
    0.55; a patch that is its own token: transparent.
    """
    import matplotlib

    gh, gw = grid
    tokens = patch_to_token.cpu().long()
    if tokens.shape != (gh * gw,):
        raise ValueError(f"patch_to_token must be ({gh * gw},) for the {gh}x{gw} grid, got {tuple(tokens.shape)}")
    overlay = np.zeros((gh * gw, 4), dtype=np.float32)
    dropped = tokens < 0
    overlay[dropped.numpy()] = (1.0, 1.0, 1.0, wash)
    sizes = torch.bincount(tokens[~dropped], minlength=int(tokens.max()) + 1 if (~dropped).any() else 1)
    merged = (~dropped) & (sizes[tokens.clamp(min=0)] > 1)
    palette = matplotlib.colormaps["tab20"]
    for rank, token in enumerate(torch.unique(tokens[merged]).tolist()):
        colour = palette(rank % 20)
        overlay[(tokens == token).numpy()] = (colour[0], colour[1], colour[2], 0.55)
    counts = {
        "kept": int(((~dropped) & ~merged).sum()),
        "merged": int(merged.sum()),
        "merged_tokens": int(torch.unique(tokens[merged]).numel()),
        "dropped": int(dropped.sum()),
    }
    return overlay.reshape(gh, gw, 4), counts


def plot_relevance(
    image: Tensor | np.ndarray,
    relevance: Tensor,
    *,
    patch_to_token: Tensor | None = None,
    alpha: float = 0.6,
    title: str = "",
    label: str = "relevance",
) -> Figure:
    """Image | relevance (gh, gw) | overlay [| kept and merged patches, when ``patch_to_token`` (P,) is given].

    Signed relevance (AttnLRP) is drawn on a diverging scale centred at 0 (red for, blue against the class);
    non-negative relevance (Chefer, rollout) on ``inferno`` from 0 to its maximum.
    """
    rgb = to_rgb(image)
    if relevance.dim() != 2:
        raise ValueError(f"relevance must be (gh, gw), got shape {tuple(relevance.shape)}")
    values = relevance.detach().float().cpu().numpy()
    signed = bool((values < 0).any())
    bound = float(np.abs(values).max()) or 1.0
    cmap, low, high = ("bwr", -bound, bound) if signed else ("inferno", 0.0, bound)
    height, width = rgb.shape[:2]
    extent = (0, width, height, 0)
    panels = 4 if patch_to_token is not None else 3
    fig = new_figure((3.0 * panels, 3.4))
    axes = fig.subplots(1, panels)
    axes[0].imshow(rgb)
    axes[0].set_title("image", fontsize=9)
    shown = axes[1].imshow(values, cmap=colormap(cmap), vmin=low, vmax=high, interpolation="nearest")
    axes[1].set_title(label, fontsize=9)
    fig.colorbar(shown, ax=axes[1], fraction=0.046, pad=0.04)
    axes[2].imshow(rgb, extent=extent)
    axes[2].imshow(values, cmap=cmap, vmin=low, vmax=high, alpha=alpha, extent=extent, interpolation="nearest")
    axes[2].set_title("overlay", fontsize=9)
    if patch_to_token is not None:
        overlay, counts = token_layout(patch_to_token, (values.shape[0], values.shape[1]))
        axes[3].imshow(rgb, extent=extent)
        axes[3].imshow(overlay, extent=extent, interpolation="nearest")
        axes[3].set_title(
            f"{counts['kept']} kept, {counts['merged']} merged into {counts['merged_tokens']}, "
            f"{counts['dropped']} dropped",
            fontsize=8,
        )
    return finish_panels(fig, axes, title)
