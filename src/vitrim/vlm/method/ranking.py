"""Rankings the methods share, pure functions of tensors: the top tokens by a score, ties to the earlier index."""

from __future__ import annotations

import torch
from torch import Tensor


def top_k_stable(scores: Tensor, k: int) -> Tensor:
    """(k,) positions of the k largest ``scores`` (n,), ascending; equal scores go to the earlier position (a stable
    descending sort), so a selection never depends on the kernel's tie order."""
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return order.sort().values


def rank_by_attention(rows: Tensor, keep: int) -> Tensor:
    """(keep,) positions, ascending, of the image tokens with the largest head-averaged attention.

    rows: (H, n) per head, the query's softmax attention on the image's n tokens (FastV, PyramidDrop)."""
    return top_k_stable(rows.mean(dim=0), keep)
