"""Attention maps: what [CLS] looks at, block by block and head by head, on the image's own patch grid.

The maps come from ``model.forward_detailed(images, need_weights=True).attentions`` (no hooks; the attention
function takes its explicit path whenever weights are asked for, whatever the default backend). For a pruned
model a block sees fewer tokens; its [CLS] row is scattered back onto the full grid with the positions of the
tokens it saw, and the patches it did not see are NaN (drawn empty).

Matplotlib is imported inside the drawing functions, and every figure is drawn on its own Agg canvas (a
``matplotlib.figure.Figure``, not pyplot): no display is needed, the global backend of the caller is left alone,
and nothing leaks into pyplot's list of open figures. Importing this module does not import matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from vitrim.extras import require
from vitrim.models.config import ViTConfig
from vitrim.models.vit import VisionTransformer

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def cls_attention_grid(
    attentions: Sequence[Tensor],
    grid: tuple[int, int],
    *,
    token_indices: Sequence[Tensor | None] | None = None,
    patch_to_token: Sequence[Tensor | None] | None = None,
    num_prefix: int = 1,
) -> Tensor:
    """The [CLS] → patch attention of every block and head, on the full patch grid.

    Args:
        attentions: one (B, H, N_b, N_b) tensor per block.
        grid: (gh, gw) patches of the image (its H // patch, W // patch), gh·gw = P.
        token_indices: per block, (B, N_b) long original token indices (prefix 0 … num_prefix−1, patch p at
            num_prefix + p), or None when the block saw all num_prefix + P tokens. See
            :func:`vitrim.viz.rollout.block_token_indices`.
        patch_to_token: instead of ``token_indices``, for merging reducers (ToMe, EViT): per block, (B, P) long,
            for each patch the index (0 … N_b − num_prefix − 1) of the patch token that stands for it, −1 if
            dropped, or None when every patch is its own token (``forward_detailed(…).block_patch_to_token``). A
            merged token's weight is drawn on every patch it stands for.
        num_prefix: prefix tokens before the patches.

    Returns:
        (B, L, H, gh, gw) float32; entry [b, l, h, y, x] is block l, head h's weight from [CLS] to the patch at
        row y, column x; NaN where block l did not see that patch.
    """
    gh, gw = grid
    P = gh * gw
    if len(attentions) == 0:
        raise ValueError("attentions must be a non-empty list of (B, H, N, N) tensors, one per block")
    if token_indices is not None and patch_to_token is not None:
        raise ValueError("pass token_indices or patch_to_token, not both")
    for name, per_block in (("token_indices", token_indices), ("patch_to_token", patch_to_token)):
        if per_block is not None and len(per_block) != len(attentions):
            raise ValueError(f"{name} has {len(per_block)} entries but attentions has {len(attentions)}")
    B, H = attentions[0].shape[:2]
    out = torch.full((B, len(attentions), H, P), float("nan"))
    for layer, attention in enumerate(attentions):
        if attention.dim() != 4 or attention.shape[:2] != (B, H):
            raise ValueError(f"attention of block {layer} must be ({B}, {H}, N, N), got {tuple(attention.shape)}")
        row = attention[:, :, 0, num_prefix:].detach().float().cpu()  # (B, H, N_b - prefix): [CLS] -> patches
        index = None if token_indices is None else token_indices[layer]
        tracked = None if patch_to_token is None else patch_to_token[layer]
        if tracked is not None:
            tracked = tracked.cpu().long()  # (B, P)
            if tracked.shape != (B, P) or int(tracked.max()) >= row.shape[-1]:
                raise ValueError(f"patch_to_token of block {layer} must be ({B}, {P}) indices below {row.shape[-1]}")
            values = row.gather(-1, tracked.clamp(min=0)[:, None, :].expand(B, H, P))  # (B, H, P)
            out[:, layer] = values.masked_fill((tracked < 0)[:, None, :], float("nan"))
        elif index is None:
            if row.shape[-1] != P:
                raise ValueError(
                    f"block {layer} saw {row.shape[-1]} patches but the grid {gh}x{gw} has {P}; "
                    "pass token_indices for a pruned model"
                )
            out[:, layer] = row
        else:
            positions = index[:, num_prefix:].cpu() - num_prefix  # (B, N_b - prefix) absolute patch positions
            if positions.shape != (row.shape[0], row.shape[2]) or int(positions.min()) < 0 or int(positions.max()) >= P:
                raise ValueError(f"token_indices of block {layer} do not match its attention or the {gh}x{gw} grid")
            out[:, layer].scatter_(-1, positions[:, None, :].expand_as(row), row)
    return out.reshape(B, len(attentions), H, gh, gw)


def model_attention_grid(model: nn.Module, image: Tensor) -> tuple[Tensor, Tensor]:
    """Run ``model`` on one image (C, H, W) or (1, C, H, W) and return (maps (L, H, gh, gw), logits (classes,)).

    Uses ``forward_detailed(need_weights=True)``; each block's map is placed with the ``patch_to_token`` map the
    block recorded as its attention ran (a merged or fused token's weight on every patch it stands for).
    """
    images = _as_batch(image)
    patch = _patch_size(model)
    grid = (images.shape[-2] // patch, images.shape[-1] // patch)
    with torch.inference_mode():
        out = model.forward_detailed(images, need_weights=True)  # type: ignore[operator]
    if not out.attentions:
        raise ValueError(f"{type(model).__name__}.forward_detailed returned no attention maps")
    num_prefix = int(getattr(model, "num_prefix", 1))
    maps = cls_attention_grid(out.attentions, grid, patch_to_token=out.block_patch_to_token, num_prefix=num_prefix)
    return maps[0], out.logits[0]


def plot_attention_maps(image: Tensor | np.ndarray, maps: Tensor, *, alpha: float = 0.6, title: str = "") -> Figure:
    """A grid of every block (rows) × head (columns): the map overlaid on the image, pruned patches empty.

    Args:
        image: the picture (C, H, W) tensor or (H, W[, C]) array; shown min-max scaled (see :func:`to_rgb`).
        maps: (L, H, gh, gw) from :func:`cls_attention_grid` (one sample); NaN = not seen by that block.
        alpha: opacity of the map over the image.

    Each map is coloured on its own scale (its min to max), since [CLS] attention spreads very differently from
    block to block.
    """
    rgb = to_rgb(image)
    if maps.dim() != 4:
        raise ValueError(f"maps must be (L, H, gh, gw) for one image, got shape {tuple(maps.shape)}")
    L, H = maps.shape[:2]
    height, width = rgb.shape[:2]
    cmap = colormap("inferno", bad=(1.0, 1.0, 1.0, 1.0))  # a patch this block never saw: blank
    fig = new_figure((1.6 * H + 0.6, 1.6 * L + 0.4))
    axes = fig.subplots(L, H, squeeze=False)
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            ax.imshow(rgb, extent=(0, width, height, 0))
            ax.imshow(
                np.ma.masked_invalid(maps[layer, head].numpy()),
                cmap=cmap,
                alpha=alpha,
                extent=(0, width, height, 0),
                interpolation="nearest",
            )
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if head == 0:
                ax.set_ylabel(f"block {layer}", fontsize=8)
    fig.suptitle(title or "[CLS] → patch attention (block × head)", fontsize=10)
    return fig


def plot_rollout(image: Tensor | np.ndarray, relevance: Tensor, *, alpha: float = 0.6, title: str = "") -> Figure:
    """Image | rollout relevance of every patch (gh, gw) | overlay."""
    rgb = to_rgb(image)
    if relevance.dim() != 2:
        raise ValueError(f"relevance must be (gh, gw), got shape {tuple(relevance.shape)}")
    height, width = rgb.shape[:2]
    fig = new_figure((9, 3.3))
    axes = fig.subplots(1, 3)
    axes[0].imshow(rgb)
    axes[0].set_title("image", fontsize=9)
    axes[1].imshow(relevance.numpy(), cmap="inferno", interpolation="nearest")
    axes[1].set_title("rollout: [CLS] ← patch", fontsize=9)
    axes[2].imshow(rgb, extent=(0, width, height, 0))
    axes[2].imshow(
        relevance.numpy(), cmap="inferno", alpha=alpha, extent=(0, width, height, 0), interpolation="nearest"
    )
    axes[2].set_title("overlay", fontsize=9)
    return finish_panels(fig, axes, title)


def finish_panels(fig: Figure, axes: Any, title: str) -> Figure:
    """Pictures, not plots: no ticks on any of ``axes``; ``title`` (if any) over the whole figure."""
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def to_rgb(image: Tensor | np.ndarray) -> np.ndarray:
    """(C, H, W) tensor (C = 1 or 3) or (H, W[, C]) array -> (H, W, 3) float in [0, 1], min-max scaled.

    Model inputs are usually normalised (mean 0, std 1); scaling each picture to its own range shows it as it is.
    """
    if isinstance(image, Tensor):
        if image.dim() == 4 and image.shape[0] == 1:
            image = image[0]
        if image.dim() != 3 or image.shape[0] not in (1, 3):
            raise ValueError(f"image tensor must be (C, H, W) with C = 1 or 3, got shape {tuple(image.shape)}")
        array = image.detach().float().cpu().permute(1, 2, 0).numpy()
    elif isinstance(image, np.ndarray):
        array = image.astype(np.float32)
        if array.ndim == 2:
            array = array[:, :, None]
        if array.ndim != 3 or array.shape[-1] not in (1, 3):
            raise ValueError(f"image array must be (H, W) or (H, W, C) with C = 1 or 3, got shape {image.shape}")
    else:
        raise TypeError(f"image must be a torch.Tensor or numpy array, got {type(image).__name__}")
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    low, high = float(array.min()), float(array.max())
    return (array - low) / (high - low) if high > low else np.zeros_like(array)


def new_figure(figsize: tuple[float, float]) -> Figure:
    """An empty figure on its own Agg canvas (headless; pyplot and the global backend are not touched)."""
    require("matplotlib", feature="drawing")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")  # makes room for titles and the suptitle
    FigureCanvasAgg(fig)
    return fig


def colormap(name: str, bad: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)) -> Any:
    """A matplotlib colormap whose colour for NaN / masked values ('bad') is ``bad`` (RGBA)."""
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=bad)


def save_figure(fig: Figure, path: Any, dpi: int = 100) -> None:
    """Write ``fig`` as PNG to ``path`` (a file name or a binary file object)."""
    fig.savefig(path, dpi=dpi, format="png")


def figure_to_rgb(fig: Figure) -> np.ndarray:
    """Render ``fig`` with Agg and return its pixels (height, width, 3) uint8."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()


def _as_batch(image: Tensor) -> Tensor:
    if not isinstance(image, Tensor):
        raise TypeError(f"image must be a torch.Tensor (C, H, W), got {type(image).__name__}")
    if image.dim() == 3:
        image = image[None]
    if image.dim() != 4 or image.shape[0] != 1:
        raise ValueError(f"image must be (C, H, W) or (1, C, H, W), got shape {tuple(image.shape)}")
    return image


def model_config(model: nn.Module) -> ViTConfig:
    """The ViTConfig of a vitrim Vision Transformer (DynamicViT's config is one too); TypeError otherwise."""
    config = getattr(model, "config", None)
    if not isinstance(config, ViTConfig) or not hasattr(model, "forward_detailed"):
        raise TypeError(f"model must be a vitrim VisionTransformer (with a ViTConfig), got {type(model).__name__}")
    return config


def vision_transformer(model: nn.Module) -> VisionTransformer:
    """``model`` as the vitrim VisionTransformer it must be (DynamicViT's is one): the type that relevance and rollout
    read (its blocks, ``embed``, ``forward_head_with_weights``); TypeError otherwise."""
    model_config(model)
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"model must be a vitrim VisionTransformer (with a ViTConfig), got {type(model).__name__}")
    return model


def _patch_size(model: nn.Module) -> int:
    return model_config(model).patch_size
