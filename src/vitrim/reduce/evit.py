"""EViT (Liang et al., ICLR 2022): keep the attentive tokens, fuse the inattentive ones into one.

In a reducing block, the n patch tokens are ranked by the [CLS] query's attention (mean over heads, from the
block's own attention: :mod:`vitrim.reduce.cls_ranking`). The top k are kept, in descending order of attention,
and the other n − k are fused into one token appended after them:

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

from vitrim.reduce.cls_ranking import ClsRankingReducer
from vitrim.reduce.registry import register
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import keep_rows


def fuse_inattentive(x: Tensor, scores: Tensor, keep: Tensor) -> Tensor:
    """(B, 1, C): Σ_i scores_i · x_i over the tokens of ``x`` (B, N, C) not in ``keep`` (B, k)."""
    # Zero the kept tokens' weights and take one (1 × N) @ (N × C) product, instead of gathering the N − k others.
    weights = scores.scatter(1, keep, 0.0)  # (B, N)
    return torch.einsum("bn,bnc->bc", weights if weights.dtype == x.dtype else weights.to(x.dtype), x)[:, None]


@register("evit")
class EViT(ClsRankingReducer):
    """Keep the top-k patch tokens by [CLS] attention and fuse the rest into one token. See module doc."""

    appends_tokens = 1

    def reduce(self, state: TokenState, scores: Tensor, index: Tensor) -> TokenState:
        # The prefix is in index (kept), so its raised scores never weigh into the fused token.
        fused = fuse_inattentive(state.tokens, scores, index)  # (B, 1, C)
        position = None
        if state.positions is not None:  # the most attentive fused patch: the best score not kept
            best_fused = scores.scatter(1, index, -1.0).argmax(dim=1, keepdim=True) - state.num_prefix  # (B, 1)
            position = state.positions.gather(1, best_fused)
        return keep_rows(state, index, fused=fused, fused_position=position)
