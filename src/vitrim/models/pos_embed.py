"""Resample a learned position embedding to another patch grid, as timm does (bicubic, antialiased) or as
transformers' ViT, DINOv2, CLIP and SigLIP do (bicubic, no antialiasing: their ``interpolate_pos_encoding``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def resample_pos_embed(
    pos_embed: Tensor, new_grid: tuple[int, int], old_grid: tuple[int, int], num_prefix: int, antialias: bool = True
) -> Tensor:
    """(1, num_prefix + h·w, D) -> (1, num_prefix + H·W, D); prefix ([CLS], distillation) positions are kept.

    The grid part is interpolated bicubically (align_corners=False) in float32, with antialiasing (timm's default)
    or without (transformers'), so weights evaluated at another image size give their library's numbers. A grid
    that does not change is returned as it is, as both libraries do.
    """
    if tuple(new_grid) == tuple(old_grid):
        return pos_embed
    expected = num_prefix + old_grid[0] * old_grid[1]
    if pos_embed.shape[1] != expected:
        raise ValueError(
            f"pos_embed has {pos_embed.shape[1]} positions, expected {num_prefix} prefix + {old_grid[0]}x{old_grid[1]}"
        )
    prefix, grid = pos_embed[:, :num_prefix], pos_embed[:, num_prefix:]
    dim = grid.shape[-1]
    grid = grid.float().reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)  # (1, D, h, w)
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", antialias=antialias, align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)
