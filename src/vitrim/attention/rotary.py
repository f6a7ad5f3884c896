"""2-D rotary position embedding (RoPE) for image patches, as EVA-02 and timm's ``RotaryEmbeddingCat`` compute it.

For a head width hd, b = hd/4 frequencies ω_i = 1 / T^(i/b) (T = temperature, 10 000). A patch at grid row y and
column x of an h × w grid (scaled to the reference grid the model was trained on: y' = y · ref_h / h,
x' = x · ref_w / w) has the angles θ = [y'·ω_0 … y'·ω_{b−1}, x'·ω_0 … x'·ω_{b−1}], each repeated twice (pairs of
channels rotate together), so θ has hd entries. A query or key row v is rotated pair by pair:

    rotate(v) = v · cos θ + rot(v) · sin θ,      rot([v0, v1, v2, v3, …]) = [−v1, v0, −v3, v2, …]

The table of one grid is (P, 2·hd): sin θ ‖ cos θ per patch, row p = y·w + x. A token's angles come from its
absolute patch position, so a token keeps its phase after others were dropped or merged.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotary_table(
    grid: tuple[int, int],
    head_dim: int,
    *,
    ref_grid: tuple[int, int] | None = None,
    temperature: float = 10000.0,
    device: torch.device | None = None,
) -> Tensor:
    """(h·w, 2·head_dim) float32: sin θ ‖ cos θ of every patch of an h × w grid, row-major (module doc)."""
    if head_dim % 4:
        raise ValueError(f"rotary embedding needs a head width divisible by 4, got {head_dim}")
    num_bands = head_dim // 4
    bands = 1.0 / temperature ** (torch.arange(num_bands, device=device, dtype=torch.float32) / num_bands)  # (b,)
    h, w = grid
    ys = torch.arange(h, device=device, dtype=torch.float32)
    xs = torch.arange(w, device=device, dtype=torch.float32)
    if ref_grid is not None:
        ys, xs = ys / h * ref_grid[0], xs / w * ref_grid[1]
    coords = torch.stack(torch.meshgrid(ys, xs, indexing="ij"), dim=-1)  # (h, w, 2): (y', x')
    angles = (coords[..., None] * bands).reshape(h * w, 2 * num_bands)  # (P, 2b): y' bands, then x' bands
    angles = angles.repeat_interleave(2, dim=-1)  # (P, hd): each angle for a pair of channels
    return torch.cat([angles.sin(), angles.cos()], dim=-1)  # (P, 2·hd)


def apply_rotary(x: Tensor, table: Tensor) -> Tensor:
    """Rotate ``x`` (…, n, hd) by ``table`` (…, n, 2·hd) (sin ‖ cos rows of the tokens' positions): module doc."""
    sin, cos = table.to(x.dtype).chunk(2, dim=-1)  # (…, n, hd) each
    pairs = x.unflatten(-1, (-1, 2))  # (…, n, hd/2, 2)
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)  # rot(x): [−x1, x0, −x3, x2, …]
    return x * cos + rotated * sin
