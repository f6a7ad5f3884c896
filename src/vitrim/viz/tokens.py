"""Kept tokens per stage (DynamicViT's figure): image | stage 1 | stage 2 | stage 3, pruned patches washed out.

``kept_indices`` is what ``forward_detailed(images).kept_indices`` returns for a pruned model: one (B, k_s) long
tensor per stage of absolute patch positions (0 … P−1, row-major on the image's patch grid). The picture needs
nothing else: :func:`kept_masks` turns the indices into the (S, gh, gw) masks that are drawn, and
:func:`render_kept_tokens` the masks into RGB arrays, where a kept patch keeps its pixels and a pruned patch is
blended towards white: ``wash · 1 + (1 − wash) · pixel``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from vitrim.viz.maps import _as_batch, _patch_size, new_figure, to_rgb

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def kept_masks(kept_indices: Sequence[Tensor], grid: tuple[int, int], sample: int = 0) -> np.ndarray:
    """(S, gh, gw) bool: True where stage s kept the patch, for one ``sample`` of the batch.

    An entry −1 is an EViT fused token that a later stage kept: it stands for patches fused earlier, none of its own
    was kept, so it marks none. Raises a ValueError for an index outside the grid or a repeated index (a stage keeps
    each patch once).
    """
    gh, gw = grid
    P = gh * gw
    if isinstance(kept_indices, Tensor) or len(kept_indices) == 0:
        raise ValueError("kept_indices must be a non-empty list of (B, k) tensors, one per stage")
    masks = np.zeros((len(kept_indices), P), dtype=bool)
    for s, kept in enumerate(kept_indices):
        if not isinstance(kept, Tensor) or kept.dim() != 2 or kept.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"kept_indices[{s}] must be a (B, k) integer tensor, got {kept!r:.80}")
        if not 0 <= sample < kept.shape[0]:
            raise ValueError(f"sample {sample} is out of range for a batch of {kept.shape[0]}")
        row = kept[sample].cpu().numpy()
        row = row[row != -1]
        if row.size and (row.min() < 0 or row.max() >= P):
            raise ValueError(f"kept_indices[{s}] holds positions {row.min()} … {row.max()}, outside the {gh}x{gw} grid")
        if np.unique(row).size != row.size:
            raise ValueError(f"kept_indices[{s}] repeats a position; each stage keeps a patch at most once")
        masks[s, row] = True
    return masks.reshape(len(kept_indices), gh, gw)


def render_kept_tokens(image: Tensor | np.ndarray, masks: np.ndarray, wash: float = 0.75) -> np.ndarray:
    """(S, gh, gw) masks on an image -> (S, H, W, 3) float RGB in [0, 1]: pruned patches blended to white.

    The image is shown min-max scaled (:func:`vitrim.viz.maps.to_rgb`); H and W must be multiples of gh and gw.
    """
    if not 0.0 <= wash <= 1.0:
        raise ValueError(f"wash must be in [0, 1], got {wash!r}")
    rgb = to_rgb(image)  # (H, W, 3)
    if masks.ndim != 3:
        raise ValueError(f"masks must be (S, gh, gw), got shape {masks.shape}")
    H, W = rgb.shape[:2]
    _, gh, gw = masks.shape
    if H % gh or W % gw:
        raise ValueError(f"image {H}x{W} is not a whole number of patches of the {gh}x{gw} grid")
    pixel_mask = masks.repeat(H // gh, axis=1).repeat(W // gw, axis=2)[..., None]  # (S, H, W, 1)
    washed = wash + (1.0 - wash) * rgb
    return np.where(pixel_mask, rgb[None], washed[None]).astype(np.float32)


def plot_kept_tokens(
    image: Tensor | np.ndarray,
    kept_indices: Sequence[Tensor],
    grid: tuple[int, int],
    *,
    sample: int = 0,
    wash: float = 0.75,
    title: str = "",
) -> tuple[Figure, np.ndarray]:
    """The figure image | stage 1 | … | stage S, and the (S, gh, gw) masks it drew (for checking)."""
    masks = kept_masks(kept_indices, grid, sample)
    panels = render_kept_tokens(image, masks, wash)
    S = len(masks)
    P = grid[0] * grid[1]
    fig = new_figure((2.4 * (S + 1), 2.8))
    axes = fig.subplots(1, S + 1, squeeze=False)[0]
    axes[0].imshow(to_rgb(image), interpolation="nearest")
    axes[0].set_title("image", fontsize=9)
    for s in range(S):
        axes[s + 1].imshow(panels[s], interpolation="nearest")
        axes[s + 1].set_title(f"stage {s + 1}: {int(masks[s].sum())}/{P} kept", fontsize=9)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    return fig, masks


def model_kept_indices(model: nn.Module, image: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
    """Run a pruning model on one image (C, H, W) in eval mode; return its kept_indices and the patch grid.

    Raises a ValueError when the model removed no tokens (a dense ViT, or a model still in training mode, where
    DynamicViT masks tokens instead of removing them).
    """
    images = _as_batch(image)
    patch = _patch_size(model)
    with torch.inference_mode():
        out = model.forward_detailed(images)  # type: ignore[operator]
    if not out.kept_indices:
        mode = "training" if model.training else "eval"
        raise ValueError(
            f"{type(model).__name__} in {mode} mode kept every token (no kept_indices); the kept-token picture "
            "needs a pruning model such as dynamicvit_* in eval mode"
        )
    return list(out.kept_indices), (images.shape[-2] // patch, images.shape[-1] // patch)
