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
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrim.attention import AttentionResult, scaled_dot_product_attention
from vitrim.reduce.base import Reducer, StrengthOption, quarter_layers
from vitrim.reduce.cls_ranking import check_keep_count, check_keep_rate, num_keep, per_layer
from vitrim.reduce.registry import register
from vitrim.reduce.schedule import Schedule
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import take_rows

HEAD_AGGREGATIONS = ("eir", "mean")


def attention_matrix(attention: AttentionResult) -> Tensor:
    """(B, H, N, N) softmax attention of the block (row = query), reused if the block returned it, else recomputed
    from its q and k with the same scale and float bias (one more QKᵀ; the fused kernel keeps running)."""
    if attention.weights is not None:
        return attention.weights
    # v = k: the output is not used and k has the right shape.
    _, weights = scaled_dot_product_attention(
        attention.q, attention.k, attention.k, attention.mask, scale=attention.scale, need_weights=True
    )
    assert weights is not None
    return weights


def weighted_page_rank(attn: Tensor, iterations: int) -> Tensor:
    """attn (B, H, N, N) row-stochastic -> (B, H, N) scores: s⁰ = 1/N, s ← Aᵀ s ``iterations`` times (sums stay 1)."""
    N = attn.shape[-1]
    s = attn.new_full((*attn.shape[:2], 1, N), 1.0 / N)  # (B, H, 1, N) as a row vector
    for _ in range(iterations):
        s = s @ attn  # (B, H, 1, N): s_j = Σ_i s_i A_ij
    return s.squeeze(-2)


def aggregate_heads(scores: Tensor, how: str) -> Tensor:
    """(B, H, N) per-head scores -> (B, N): root mean square over heads ("eir") or the mean."""
    if how == "eir":
        return scores.square().mean(dim=1).sqrt()
    return scores.mean(dim=1)


@torch.no_grad()
def zero_tprune_keep(importance: Tensor, metric: Tensor, k: int, similarity_share: float) -> Tensor:
    """(B, k) patch-token indices kept, in descending importance.

    importance: (B, n) scores of the patch tokens; metric: (B, n, C) their similarity features; k: tokens kept.
    """
    n = importance.shape[1]
    r = n - k
    r_s = min(math.floor(similarity_share * r), k)
    m = n - (r - r_s)  # survivors of the I-stage
    # topk, not a stable sort: it exports to ONNX (ties, which float scores do not produce, may stand either way)
    survivors = importance.topk(m, dim=1).indices  # (B, m) most important first
    if r_s == 0:
        return survivors
    keepers, candidates = survivors[:, : m // 2], survivors[:, m // 2 :]  # (B, ⌊m/2⌋), (B, ⌈m/2⌉)
    metric = F.normalize(metric, dim=-1)
    sim = take_rows(metric, candidates) @ take_rows(metric, keepers).transpose(1, 2)  # (B, ⌈m/2⌉, ⌊m/2⌋) cosine
    redundancy = sim.max(dim=-1).values  # (B, ⌈m/2⌉)
    stay = (-redundancy).topk(candidates.shape[1] - r_s, dim=1).indices  # (B, ⌈m/2⌉ − r_S) least similar
    stay = stay.sort(dim=1).values  # back to importance order
    return torch.cat([keepers, candidates.gather(1, stay)], dim=1)


@register("zero_tprune")
class ZeroTPrune(Reducer):
    """Prune by Weighted-PageRank importance on the block's attention graph, then by similarity (see module doc).

    Options: ``keep_rate`` in (0, 1] or ``keep_count`` (patch tokens kept; one, or one per reducing block);
    ``similarity_share`` in [0, 1] (the part of the removed tokens the S-stage picks); ``iterations`` (WPR steps);
    ``head_aggregation`` ("eir" or "mean"); ``layers`` (default a quarter, half and three quarters deep).
    """

    example_options: ClassVar[dict[str, Any]] = {"keep_rate": 0.5, "layers": (1, 3)}
    identity_options: ClassVar[dict[str, Any]] = {"keep_rate": 1.0, "layers": (0, 1, 2, 3)}
    strength_option: ClassVar[StrengthOption | None] = StrengthOption("keep_rate", 1.0, 0.001, step=0.001)

    def __init__(
        self,
        keep_rate: float = 0.7,
        keep_count: int | None = None,
        similarity_share: float = 0.5,
        iterations: int = 30,
        head_aggregation: str = "eir",
    ) -> None:
        self.keep_rate = check_keep_rate(keep_rate)
        self.keep_count = check_keep_count(keep_count)
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

    @classmethod
    def default_layers(cls, depth: int) -> tuple[int, ...]:
        return quarter_layers(depth)

    @classmethod
    def for_layers(  # type: ignore[override]  # a reducer takes its own options; apply checks their names
        cls,
        layers: tuple[int, ...],
        *,
        keep_rate: float | Sequence[float] = 0.7,
        keep_count: int | Sequence[int] | None = None,
        similarity_share: float = 0.5,
        iterations: int = 30,
        head_aggregation: str = "eir",
    ) -> dict[int, Reducer | None]:
        rates = per_layer("keep_rate", keep_rate, layers)
        counts = per_layer("keep_count", keep_count, layers)
        return {
            layer: cls(rate, count, similarity_share, iterations, head_aggregation)
            for layer, rate, count in zip(layers, rates, counts)
        }

    @classmethod
    def options_for_schedule(cls, schedule: Schedule) -> tuple[tuple[int, ...], dict[str, Any]]:
        """The reducing blocks of the schedule, each keeping the patch tokens that leave its count."""
        steps = schedule.reductions()
        return tuple(i for i, _, _ in steps), {"keep_count": [after - schedule.num_prefix for _, _, after in steps]}

    def num_kept(self, n: int) -> int:
        """Patch tokens kept of the n entering: ``keep_count`` (capped at n), else ⌈keep_rate · n⌉."""
        return min(n, self.keep_count) if self.keep_count is not None else num_keep(n, self.keep_rate)

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        n, p = state.num_patch_tokens, state.num_prefix
        k = self.num_kept(n)
        if k >= n:
            return state
        if state.keep_policy is not None:
            raise ValueError("Zero-TPrune cannot follow a training-time keep_policy (DynamicViT training); got one")
        with torch.no_grad():
            scores = weighted_page_rank(attention_matrix(attention), self.iterations)  # (B, H, N)
            importance = aggregate_heads(scores, self.head_aggregation)[:, p:]  # (B, n)
        keep = zero_tprune_keep(importance, attention.k.mean(dim=1)[:, p:], k, self.similarity_share)
        return self.keep(state, keep)

    def extra_repr(self) -> str:
        kept = f"keep_count={self.keep_count}" if self.keep_count is not None else f"keep_rate={self.keep_rate}"
        return f"{kept}, similarity_share={self.similarity_share}, iterations={self.iterations}"
