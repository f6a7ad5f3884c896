"""EViT (Liang et al., ICLR 2022): keep the attentive tokens, fuse the inattentive ones into one.

In a reducing block, the n patch tokens are ranked by the [CLS] query's attention (mean over heads, from the
block's own attention: :mod:`vitrim.reduce.attention_row`). The top k = max(1, ⌊n · keep_rate⌋) are kept, in
descending order of attention, and the other n − k are fused into one token appended after them:

    x_fused = Σ_{i inattentive} a_i · x_i          a_i = [CLS] attention to token i (mean over heads)

a sum weighted by attention, not renormalised, exactly as the authors' code (``extra_token``) computes it.
Prefix tokens ([CLS], DeiT's distillation token) are never ranked or fused. With k = n nothing changes.

Bookkeeping: ``kept_indices`` gets the absolute positions of the k real kept patches only. The fused token's entry in
``positions`` is the position of the most attentive fused patch (a real grid position, so code that indexes by
position stays valid); ``patch_to_token`` sends every fused patch to the fused token. If tokens carry sizes (after
ToMe), the fused token's size is the sum of the fused sizes; EViT itself adds no sizes (no proportional attention).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitrim.reduce.attention_row import cls_attention_to_patches
from vitrim.reduce.base import AttentionInfo, Reducer, TokenState
from vitrim.reduce.rows import take_rows
from vitrim.reduce.topk import (
    check_keep_rate,
    check_state,
    keep_destinations,
    num_keep,
    rank_by_score,
    with_prefix,
)
from vitrim.reduce.tracking import record_reduction


def fuse_inattentive(x: Tensor, scores: Tensor, order: Tensor, k: int, num_prefix: int) -> Tensor:
    """Keep the prefix and the k best patch tokens; fuse the other patch tokens with their scores as weights.

    Args:
        x: (B, num_prefix + n, C) tokens, prefix first.
        scores: (B, n) [CLS] attention to each patch token.
        order: (B, n) patch-token indices by descending score (:func:`rank_by_score`).
        k: tokens kept, 1 <= k < n.

    Returns:
        (B, num_prefix + k + 1, C): the prefix, the kept tokens in ``order``, then the fused one.
    """
    keep = order[:, :k]  # (B, k)
    # Zero the kept tokens' weights and take one (1 × n) @ (n × C) product, instead of gathering the n − k others.
    weights = scores.scatter(1, keep, 0.0)  # (B, n)
    fused = weights.unsqueeze(1).to(x.dtype) @ x[:, num_prefix:]  # (B, 1, C)
    return torch.cat([take_rows(x, with_prefix(keep, num_prefix)), fused], dim=1)


class EViT(Reducer):
    """Keep the top-k patch tokens by [CLS] attention and fuse the rest into one token. See module doc."""

    stage = "mid"
    needs_attention = True

    def __init__(self, keep_rate: float) -> None:
        self.keep_rate = check_keep_rate(keep_rate)

    def __call__(self, state: TokenState, info: AttentionInfo | None) -> TokenState:
        p = state.num_prefix
        x = state.tokens  # (B, N, C)
        n = x.shape[1] - p
        k = num_keep(n, self.keep_rate)
        if k >= n:
            return state
        info = check_state(state, info, "EViT")
        scores = cls_attention_to_patches(info, p)  # (B, n)
        order = rank_by_score(scores)  # (B, n)
        tokens = fuse_inattentive(x, scores, order, k, p)  # (B, p + k + 1, C)
        keep = order[:, :k]
        kept_positions = state.positions.gather(1, keep)  # (B, k)
        fused_position = state.positions.gather(1, order[:, k : k + 1])  # (B, 1): most attentive fused patch
        sizes = state.sizes
        if sizes is not None:
            patch_sizes = sizes[:, p:]
            fused_size = patch_sizes.sum(1, keepdim=True) - patch_sizes.gather(1, keep).sum(1, keepdim=True)
            sizes = torch.cat([sizes[:, :p], patch_sizes.gather(1, keep), fused_size], dim=1)
        return state.replace(
            tokens=tokens,
            positions=torch.cat([kept_positions, fused_position], dim=1),
            sizes=sizes,
            kept_indices=(*state.kept_indices, kept_positions),
            patch_to_token=record_reduction(state, keep_destinations(keep, n, k)),
        )

    def extra_repr(self) -> str:
        return f"keep_rate={self.keep_rate}"
