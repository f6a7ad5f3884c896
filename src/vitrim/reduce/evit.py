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

from torch import Tensor

from vitrim.reduce.cls_ranking import ClsRankingReducer
from vitrim.reduce.registry import register
from vitrim.reduce.state import TokenState


def fuse_inattentive(x: Tensor, scores: Tensor, keep: Tensor) -> Tensor:
    """(B, 1, C): Σ_i scores_i · x_i over the patch tokens ``x`` (B, n, C) not in ``keep`` (B, k)."""
    # Zero the kept tokens' weights and take one (1 × n) @ (n × C) product, instead of gathering the n − k others.
    weights = scores.scatter(1, keep, 0.0)  # (B, n)
    return weights.unsqueeze(1).to(x.dtype) @ x  # (B, 1, C)


@register("evit")
class EViT(ClsRankingReducer):
    """Keep the top-k patch tokens by [CLS] attention and fuse the rest into one token. See module doc."""

    appends_tokens = 1

    def reduce(self, state: TokenState, scores: Tensor, order: Tensor, k: int) -> TokenState:
        keep = order[:, :k]  # (B, k)
        fused = fuse_inattentive(state.tokens[:, state.num_prefix :], scores, keep)
        most_attentive_fused = state.positions.gather(1, order[:, k : k + 1])  # (B, 1)
        return self.keep(state, keep, fused=fused, fused_position=most_attentive_fused)
