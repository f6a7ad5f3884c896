"""Pooled image tokens: per-patch evidence brought onto the pooled grid the LLM receives.

Gemma 3's tokens are average-pooled cells of the tower's patch grid (:func:`pool_to_tokens`: summed or averaged per
cell); LLaVA-OneVision's video tokens are a bilinear resize of each frame's patch grid (:func:`resize_to_tokens`:
the same resize applied to the evidence, so a pooled token's score is the weighted mean of the patches it reads)."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import functional as F


def pool_to_tokens(values: Tensor, kernel: int, reduce: str) -> Tensor:
    """(I, P, ...) per patch of a p×p grid -> (I, t², ...) per pooled token (t = p / kernel), raster order.

    ``reduce``: "mean" (the projector's average pool: keys) or "sum" (the attention mass of the k×k patches).
    """
    images, patches = values.shape[:2]
    side = math.isqrt(patches)
    tokens_side = side // kernel
    rest = values.shape[2:]
    grid = values.reshape(images, tokens_side, kernel, tokens_side, kernel, *rest)
    grouped = grid.transpose(2, 3).reshape(images, tokens_side * tokens_side, kernel * kernel, *rest)
    return grouped.mean(2) if reduce == "mean" else grouped.sum(2)


def resize_to_tokens(values: Tensor, rows: int, columns: int) -> Tensor:
    """(I, P, ...) per patch of a p×p grid -> (I, rows·columns, ...) per pooled token, raster order: the bilinear
    resize LLaVA-OneVision's ``apply_pooling`` makes of a frame (``F.interpolate``, ``align_corners=False``), applied
    to every trailing channel alike (computed in float32 at least)."""
    images, patches = values.shape[:2]
    side = math.isqrt(patches)
    rest = values.shape[2:]
    work = torch.promote_types(values.dtype, torch.float32)
    grid = values.reshape(images, side, side, -1).permute(0, 3, 1, 2).to(work)  # (I, C, p, p)
    resized = F.interpolate(grid, size=[rows, columns], mode="bilinear")  # (I, C, rows, columns)
    return resized.permute(0, 2, 3, 1).reshape(images, rows * columns, *rest)
