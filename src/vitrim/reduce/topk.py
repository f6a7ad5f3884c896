"""Top-k by [CLS] attention: keep the k patch tokens the [CLS] query attends to most, drop the rest (the baseline).

Ranking, counts and default blocks are EViT's (:mod:`vitrim.reduce.cls_ranking`); ``kept_indices`` gets the kept
tokens' absolute patch positions in descending order of attention. With k = n the state passes through untouched.
"""

from __future__ import annotations

from torch import Tensor

from vitrim.reduce.cls_ranking import ClsRankingReducer
from vitrim.reduce.registry import register
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import keep_rows


@register("topk")
class TopK(ClsRankingReducer):
    """Keep the top-k patch tokens by [CLS] attention (mean over heads); drop the others. See module doc."""

    def reduce(self, state: TokenState, scores: Tensor, index: Tensor) -> TokenState:
        return keep_rows(state, index)
