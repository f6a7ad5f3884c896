"""Gemma 3's image tokens are pooled cells of the tower's patch grid: per-patch evidence summed or averaged per cell."""

from __future__ import annotations

import math

from torch import Tensor


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
