"""Zero-TPrune (Wang, Dedhia & Jha, CVPR 2024): training-free pruning by importance on the attention graph, then by
similarity.

No code by the authors could be found (Papers with Code lists none; no repository of theirs is among the sources
read for this file), so every convention below follows the paper's description, and where the paper leaves a choice
open or where its text could not be checked here, the choice made is marked *adopted*:

* Where: in the blocks of ``layers`` (default *adopted*: a quarter, half and three quarters deep, 3, 6, 9 of 12, where
  EViT and DynamicViT prune), after the attention residual, before the MLP (``after_attention``), from that block's
  own attention matrix.
* Graph: the block's softmax attention A (B, H, N, N) of one head is the adjacency matrix of a directed graph; row i
  (query i) is how token i distributes its attention, so A_ij is the weight of the edge by which token i "votes"
  for token j. The graph has every token, prefix tokens included (*adopted*: their rows keep A row-stochastic, so
  the scores stay a distribution; only patch tokens' scores are used afterwards).
* I-stage, Weighted Page Rank (WPR): s⁰ = 1/N for every token, s^{t+1}_j = Σ_i A_ij · s^t_i (s ← Aᵀs: a token is
  important when important tokens attend to it), for a fixed number of ``iterations`` (default 30, *adopted*: the
  paper iterates until the scores settle; a fixed count keeps the graph static, so it exports). One score vector
  per head.
* Heads: combined per token by ``head_aggregation``: ``"eir"`` (default) = √(mean_h s_h²), *adopted* from our reading
  of the paper's "emphasising informative region" aggregation (a token that one head finds important outweighs one
  that all heads find mildly important; the exact formula could not be checked against a source here); ``"mean"``:
  the average. The paper's variance-based head filter is not implemented.
* Counts (static per block, from the n patch tokens entering it): k = ⌈keep_rate · n⌉ kept (EViT's rule, in floats
  as :func:`vitrim.reduce.cls_ranking.num_keep`), or ``keep_count`` exactly (capped at n; a DiffRate ``schedule``
  sets it per block: :mod:`vitrim.reduce.schedule`); r = n − k removed, of which
  r_S = min(⌊similarity_share · r⌋, k) by the S-stage and r_I = r − r_S by the I-stage (*adopted*: the paper sets the
  split per configuration; ``similarity_share`` 0 is importance-only pruning).
* I-stage pruning: the r_I patch tokens with the lowest score go.
* S-stage: the m = n − r_I survivors, ranked by score, are split into the more important half (the ⌊m/2⌋ best, the
  keepers' group) and the less important half (the other ⌈m/2⌉, the candidates); each candidate's similarity to
  the keepers' group is its largest cosine similarity to any of them, on the keys averaged over heads (*adopted*: as
  ToMe; the paper compares several features and metrics); the r_S most similar candidates go (pruned, not merged).
* Layout: the kept patch tokens stand in descending importance (keepers' group, then the surviving candidates);
  ``kept_indices`` and ``patch_to_token`` record them as top-k does (:meth:`Reducer.keep`).
* Protected: every prefix token ([CLS], distillation token, registers) is kept and never scored. No [CLS] is needed
  (models without one work).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrim.attention import AttentionResult, scaled_dot_product_attention
from vitrim.reduce.cls_ranking import KeepCountReducer
from vitrim.reduce.index_cache import cached
from vitrim.reduce.registry import register
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import keep_rows

HEAD_AGGREGATIONS = ("eir", "mean")


def attention_matrix(attention: AttentionResult) -> Tensor:
    """(B, H, N, N) softmax attention of the block (row = query), reused if the block returned it, else recomputed
    from its q and k with the same scale and float bias (one more QKᵀ; the fused kernel keeps running).

    Half-precision inputs give float32 weights (the softmax accumulates in float32)."""
    if attention.weights is not None:
        return attention.weights
    if attention.mask is None:  # the common case, in two calls
        k = attention.k
        scale = cached(("scale", attention.scale, k.dtype, k.device), lambda: k.new_tensor(attention.scale))
        logits = torch.einsum("bhic,bhjc,->bhij", attention.q, k, scale)  # (B, H, N, N)
        half = logits.dtype in (torch.float16, torch.bfloat16)
        return logits.softmax(dim=-1, dtype=torch.float32) if half else logits.softmax(dim=-1)
    # v = k: the output is not used and k has the right shape.
    _, weights = scaled_dot_product_attention(
        attention.q, attention.k, attention.k, attention.mask, scale=attention.scale, need_weights=True
    )
    assert weights is not None
    return weights


MAX_CHAIN = 40  # steps per einsum call: each step takes two subscripts of the 52 einsum has


def weighted_page_rank(attn: Tensor, iterations: int) -> Tensor:
    """attn (B, H, N, N) row-stochastic -> (B, H, N) scores: s⁰ = 1/N, s ← Aᵀ s ``iterations`` times (sums stay 1).

    The steps are one chained product s⁰ A A … A per call of ``einsum``: it contracts its operands left to right, so
    each step stays a vector-matrix product (never A·A), and the host makes one call instead of ``iterations``.
    """
    N = attn.shape[-1]
    s = cached(("uniform", N, attn.dtype, attn.device), lambda: attn.new_full((1, 1, N), 1.0 / N))  # (1, 1, N)
    done = 0
    while done < iterations:
        steps = min(MAX_CHAIN, iterations - done)
        operands: list[object] = [s, [0, 1, 2]]
        for t in range(steps):
            operands += [attn, [0, 1, 2 + t, 3 + t]]
        s = torch.einsum(*operands, [0, 1, 2 + steps])  # (B, H, N): s_j = Σ_i s_i A_ij, ``steps`` times
        done += steps
    return s


def head_importance(scores: Tensor, how: str) -> Tensor:
    """(B, H, N) per-head scores -> (B, N), in one call: for "eir" the norm over heads (√H times their root mean
    square), for "mean" their sum (H times the mean); the factors leave the ranking alone. Values lie in [0, H]."""
    return torch.linalg.vector_norm(scores, dim=1) if how == "eir" else scores.sum(dim=1)


def _candidate_pairs(num_survivors: int, num_prefix: int, num_keepers: int, device: torch.device) -> Tensor:
    """(S, S) float: 0 where the row is a candidate (the survivors after the keepers) and the column a keeper
    (survivors p … p + keepers − 1), −∞ elsewhere (rows and columns in survivor order, prefix first)."""
    i = torch.arange(num_survivors, device=device)
    candidate = i >= num_prefix + num_keepers
    keeper = (i >= num_prefix) & ~candidate
    return torch.zeros(num_survivors, num_survivors, device=device).masked_fill(
        ~(candidate[:, None] & keeper[None, :]), float("-inf")
    )


@torch.no_grad()
def zero_tprune_keep(
    importance: Tensor, metric: Tensor, k: int, similarity_share: float, num_prefix: int = 0
) -> Tensor:
    """(B, p + k) token indices kept: the p prefix tokens, then the kept patch tokens in descending importance.

    importance: (B, N) scores of all N tokens, the prefix's raised above every patch token's (in order); metric:
    (B, N, C) similarity features; k: patch tokens kept.
    """
    p = num_prefix
    n = importance.shape[1] - p
    r = n - k
    r_s = min(math.floor(similarity_share * r), k)
    m = n - (r - r_s)  # survivors of the I-stage
    # topk, not a stable sort: it exports to ONNX (ties, which float scores do not produce, may stand either way)
    survivors = importance.topk(p + m, dim=1).indices  # (B, p + m): prefix, then the most important first
    if r_s == 0:
        return survivors
    # Each candidate's redundancy: its best cosine similarity to a keeper, over the survivors' rows at once.
    B, device = importance.shape[0], importance.device
    unit = F.rms_norm(metric, (metric.shape[-1],), eps=torch.finfo(metric.dtype).tiny)  # (B, N, C) unit · √C
    picked = unit[cached(("batch_rows", B, device), lambda: torch.arange(B, device=device)[:, None]), survivors]
    pairs = cached(
        ("zt_pairs", p + m, p, m // 2, metric.dtype, device),
        lambda: _candidate_pairs(p + m, p, m // 2, device).to(metric.dtype),
    )
    redundancy = torch.baddbmm(pairs, picked, picked.mT).amax(dim=-1)  # (B, p + m): −∞ but for candidates
    dropped = redundancy.topk(r_s, dim=1).indices  # (B, r_S) the most similar candidates, in survivor order
    order = cached(("survivor_order", B, p + m, device), lambda: torch.arange(p + m, device=device).repeat(B, 1))
    stay = order.scatter(1, dropped, p + m).topk(p + m - r_s, dim=1, largest=False).indices  # ascending
    return survivors.gather(1, stay)  # (B, p + k): keepers, then the candidates that stay, in importance order


@register("zero_tprune")
class ZeroTPrune(KeepCountReducer):
    """Prune by Weighted-PageRank importance on the block's attention graph, then by similarity (see module doc).

    Options: ``keep_rate`` in (0, 1] or ``keep_count`` (patch tokens kept; one, or one per reducing block);
    ``similarity_share`` in [0, 1] (the part of the removed tokens the S-stage picks); ``iterations`` (WPR steps);
    ``head_aggregation`` ("eir" or "mean"); ``layers`` (default a quarter, half and three quarters deep).
    """

    def __init__(
        self,
        keep_rate: float = 0.7,
        keep_count: int | None = None,
        similarity_share: float = 0.5,
        iterations: int = 30,
        head_aggregation: str = "eir",
    ) -> None:
        super().__init__(keep_rate, keep_count)
        if (
            isinstance(similarity_share, bool)
            or not isinstance(similarity_share, (int, float))
            or not 0.0 <= similarity_share <= 1.0
        ):
            raise ValueError(
                f"similarity_share must be a number in [0, 1] (share of the removed tokens chosen by similarity), "
                f"got {similarity_share!r}"
            )
        self.similarity_share = float(similarity_share)
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations must be an int >= 1 (Weighted PageRank steps), got {iterations!r}")
        self.iterations = iterations
        if head_aggregation not in HEAD_AGGREGATIONS:
            raise ValueError(f"head_aggregation must be one of {HEAD_AGGREGATIONS}, got {head_aggregation!r}")
        self.head_aggregation = head_aggregation

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        n, p = state.num_patch_tokens, state.num_prefix
        k = self.num_kept(n)
        if k >= n:
            return state
        if state.keep_policy is not None:
            raise ValueError("Zero-TPrune cannot follow a training-time keep_policy (DynamicViT training); got one")
        with torch.no_grad():
            scores = weighted_page_rank(attention_matrix(attention), self.iterations)  # (B, H, N)
            importance = head_importance(scores, self.head_aggregation)  # (B, N) in [0, H]
            H, N = scores.shape[1], scores.shape[2]
            raise_prefix = cached(
                ("zt_prefix", N, p, H, importance.dtype, importance.device),
                lambda: (
                    (torch.arange(N, device=importance.device) < p).to(importance.dtype)
                    * (H + 1 + p - torch.arange(N, device=importance.device))
                ),
            )  # (N,): H + 1 + p − i for prefix token i (above every score, decreasing), 0 for patch tokens
            # keys summed over heads: the direction of their mean, all that a cosine sees
            index = zero_tprune_keep(importance + raise_prefix, attention.k.sum(dim=1), k, self.similarity_share, p)
        return keep_rows(state, index)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, similarity_share={self.similarity_share}, iterations={self.iterations}"
