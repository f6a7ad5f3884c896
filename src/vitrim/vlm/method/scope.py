"""``scope`` (Deng et al., NeurIPS 2025, "SCOPE: Saliency-Coverage Oriented Token Pruning for Efficient Multimodal
LLMs"): keep tokens one at a time, each the one whose coverage gain × saliency^α is largest.

Written from the paper (kinredon/SCOPE has no licence file; its code was not read). Per image, on the N tower
features x (those entering the projector) with s(i, j) = cos(x_i, x_j) and the saliency a_i (the [CLS] attention
row of the scoring layer averaged over heads; on a tower without [CLS], the attention the token receives there):

- the coverage of a selected set S: c(S) = Σ_j max(0, max_{i∈S} s(i, j)) (how well S stands for every token; c(∅)
  = 0, a token with no positive similarity to S is not covered at all);
- the coverage gain of a token i ∉ S: Δ(i | S) = c(S ∪ {i}) − c(S) = Σ_j max(0, s(i, j) − m_j), with m_j =
  max(0, max_{t∈S} s(t, j)) the coverage token j already has;
- the SCOPE score a_i^α · Δ(i | S); ``keep`` times the token with the largest score joins S (ties to the lower
  index) and m is updated.

α = 0 is pure coverage (a facility-location greedy); a large α approaches saliency top-k. vitrim reads the gain
from one N×N similarity and a running m (k rounds of O(N²)). Where this could differ from the authors' numbers:
the paper's equations were followed as summarised here (the clipping of negative similarities at 0 and α's value
are vitrim's reading of them), and ties go to the lower index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost, cls_row_macs
from vitrim.vlm.method.fastervlm import cls_scores, kept_as_selection

SCOPE_ALPHA = 1.0


def scope_keep(features: Tensor, saliency: Tensor, keep: int, alpha: float = SCOPE_ALPHA) -> Tensor:
    """(keep,) long in selection order: SCOPE's greedy saliency-weighted coverage on one image.

    features: (N, D) the tokens whose cosine similarity defines coverage; saliency: (N,) a_i ≥ 0.
    """
    # float64; and where a^α underflows for a token whose a > 0 (large α: from α = 5 in float16 every token's is 0,
    # so the greedy would take the first index each step) a^α · Δ is compared as α·log a + log Δ
    unit = features.double() / features.double().norm(dim=-1, keepdim=True)
    similarity = (unit @ unit.T).fill_diagonal_(1.0)  # (N, N); cos(x, x) = 1 exactly, so ties are ties
    salient = saliency.double().clamp(min=0)
    weight = salient**alpha  # (N,) a^α (0^0 = 1: α = 0 ignores saliency)
    in_logs = bool(((weight == 0) & (salient > 0)).any())
    log_weight = alpha * salient.log() if in_logs else weight
    covered = similarity.new_zeros(features.shape[0])  # (N,) m_j
    taken = torch.zeros(features.shape[0], dtype=torch.bool, device=features.device)
    lowest = torch.finfo(torch.float64).min  # log of a zero product: below every positive one, above a taken token
    chosen = []
    for _ in range(keep):
        gain = (similarity - covered[None, :]).clamp(min=0).sum(dim=-1)  # (N,) Δ(i | S)
        score = (log_weight + gain.log()).nan_to_num(nan=lowest, neginf=lowest) if in_logs else weight * gain
        score = score.masked_fill(taken, -torch.inf)
        best = int(torch.argmax(score))  # the first maximum: ties to the lower index
        chosen.append(best)
        taken[best] = True
        covered = torch.maximum(covered, similarity[best].clamp(min=0))
    return torch.tensor(chosen, dtype=torch.long, device=features.device)


@register_method("scope", stage="pre_llm")
class Scope(Method):
    """Greedy coverage × [CLS]-attention^α. Options: ``alpha`` (float ≥ 0, default 1.0)."""

    defaults: ClassVar[Mapping[str, Any]] = {"alpha": SCOPE_ALPHA}
    needs_cls_attention = True

    def check(self) -> None:
        alpha = self.options["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha < math.inf:
            raise ValueError(f"alpha={alpha!r} must be a finite number >= 0")

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        alpha = float(self.options["alpha"])
        return [
            kept_as_selection(scope_keep(features, saliency, keep, alpha))
            for features, saliency in zip(evidence.features, cls_scores(evidence), strict=True)
        ]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """The saliency ([CLS] row), then the tower features' N × N cosines (the greedy rounds add no products)."""
        n, d = model.image_tokens, model.tower.width
        return MethodCost.before_llm(keep, cls_row_macs(model.tower) + n * n * d)
