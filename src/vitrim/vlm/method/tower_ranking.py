"""[CLS]-ranking reducers (EViT, top-k, PPT) in a tower without [CLS] (SigLIP: Gemma 3): the attention RECEIVED.

EViT and top-k rank a block's patch tokens by the [CLS] row of its attention, PPT weighs that row by ‖v‖. A SigLIP
tower has no [CLS], so here the row is replaced by the attention each token receives, as the toolkits score
[CLS]-less towers and as vitrim.vlm's pre-LLM methods do on Gemma 3 and Qwen (``vitrim.vlm.families.gemma3``):

    r_j = (1/N) Σ_i softmax_j(q_i · kᵀ · scale + bias)          per head, i over the N tokens entering the block

computed from the block's own q and k (and the log-size bias of proportional attention, when an earlier merge set
one); per image and head the r_j sum to 1, as a [CLS] row does. It is one more N × N map per reducing block (taken
``QUERY_CHUNK`` queries at a time), and the block's own attention stays on its backend. With that row EViT and top-k
are their own code at no prefix (k = ⌈keep_rate · n⌉ best by r averaged over heads, descending; EViT fuses the rest
weighted by it), and PPT reads it as its [CLS] row. DiffRate, whose ranking is tied to its [CLS] layout, is refused.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from vitrim.attention import AttentionResult
from vitrim.reduce import Reducer, TokenState
from vitrim.reduce.cls_ranking import ClsRankingReducer
from vitrim.vlm.evidence import attention as evidence

RANKS_BY_THE_ROW = ("ppt",)  # reducers that read the [CLS] row only through AttentionResult.weights (cls_rows)


def received_attention(q: Tensor, k: Tensor, scale: float, bias: Tensor | None) -> Tensor:
    """(B, H, 1, N): per head, the softmax attention each of the N keys receives, averaged over the N queries.

    q, k: (B, H, N, hd); bias: None or additive, broadcastable to (B, H, N, N) (the seam's (B, 1, 1, N) log-sizes)."""
    return (evidence.received_attention(q, k, scale, bias) / q.shape[-2])[:, :, None]


class ReceivedAttentionRanking(Reducer):
    """A [CLS]-ranking reducer (``inner``) run on a tower without [CLS], ranking by :func:`received_attention`."""

    def __init__(self, inner: Reducer) -> None:
        self.inner = inner

    def before_attention(self, state: TokenState) -> TokenState:
        return self.inner.before_attention(state)

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        inner = self.inner
        if isinstance(inner, ClsRankingReducer):
            n = state.num_patch_tokens
            k = inner.num_kept(n)
            if k >= n:
                return state
            scores = self.row(attention).mean(dim=(1, 2))  # (B, N): no prefix to raise above the patches
            return inner.reduce(state, scores, scores.topk(k, dim=1).indices)
        return inner.after_attention(state, replace(attention, weights=self.row(attention)))

    @staticmethod
    def row(attention: AttentionResult) -> Tensor:
        return received_attention(attention.q, attention.k, attention.scale, attention.mask)

    def extra_repr(self) -> str:
        return f"{type(self.inner).__name__} ranked by received attention"


def for_tower_without_cls(name: str, reducers: dict[int, Reducer]) -> dict[int, Reducer]:
    """``reducers`` of the [CLS]-ranking reducer ``name``, each ranking by received attention; ``ValueError`` for
    one whose ranking cannot be given another row (DiffRate)."""
    if not all(isinstance(r, ClsRankingReducer) for r in reducers.values()) and name not in RANKS_BY_THE_ROW:
        raise ValueError(
            f"reducer {name!r} ranks tokens by [CLS] attention in a way tied to [CLS]; this tower (SigLIP) has no "
            "[CLS] (evit, topk and ppt rank by the attention each token receives there instead)"
        )
    return {index: ReceivedAttentionRanking(reducer) for index, reducer in reducers.items()}


__all__ = ["ReceivedAttentionRanking", "for_tower_without_cls", "received_attention"]
