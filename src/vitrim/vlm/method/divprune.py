"""``divprune`` (Alvar et al., CVPR 2025, "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal
Models"): keep the ``keep`` image tokens that are most diverse, as a max-min diversity problem solved greedily.

Written from the paper (its code is CC BY-NC and was not read). On the image's tokens as the LLM would receive them
(the projector's output), with the cosine distance d(i, j) = 1 − cos(x_i, x_j):

1. the first token is the one whose nearest other token is farthest: argmax_i min_{j≠i} d(i, j);
2. each next token is the one farthest from the selected set: argmax_{i∉S} min_{j∈S} d(i, j),

until ``keep`` tokens are selected (ties to the lower index). No [CLS] attention is needed, so it applies to any
tower; the cost is one N×N similarity per image (576² for LLaVA-1.5) and ``keep`` vector updates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost
from vitrim.vlm.method.fastervlm import kept_as_selection


def cosine_distance(tokens: Tensor) -> Tensor:
    """(N, N) 1 − cos(x_i, x_j) of ``tokens`` (N, D), BITWISE symmetric. A matmul rounds entry (i, j) and entry
    (j, i) in different places of its tiles, so they may differ in the last bit; two mutual nearest neighbours,
    whose scores in the first step are the same distance, would then be told apart by that bit, and the bit by the
    other images of the batch (the kernel a matmul picks, the tower's own rounding). Averaging with the transpose
    is exact symmetry (a + b = b + a in floating point), so such a pair ties exactly and goes to the lower index."""
    normalized = tokens / tokens.norm(dim=-1, keepdim=True)  # (N, D)
    distance = 1.0 - normalized @ normalized.T  # (N, N)
    return (distance + distance.T) / 2


def divprune_keep(tokens: Tensor, keep: int) -> Tensor:
    """(keep,) long in selection order: the greedy max-min diverse subset of ``tokens`` (N, D)."""
    distance = cosine_distance(tokens)  # (N, N), bitwise symmetric
    num_tokens = tokens.shape[0]
    if num_tokens == 1:
        return torch.zeros(1, dtype=torch.long, device=tokens.device)
    eye = torch.eye(num_tokens, dtype=torch.bool, device=tokens.device)
    nearest_other = distance.masked_fill(eye, float("inf")).min(-1).values  # (N,)
    chosen = [int(nearest_other.argmax())]
    to_selected = distance[:, chosen[0]].clone()  # (N,) min distance to the selected set
    taken = torch.zeros(num_tokens, dtype=torch.bool, device=tokens.device)
    taken[chosen[0]] = True
    for _ in range(keep - 1):
        candidate = int(to_selected.masked_fill(taken, float("-inf")).argmax())
        chosen.append(candidate)
        taken[candidate] = True
        to_selected = torch.minimum(to_selected, distance[:, candidate])
    return torch.tensor(chosen, dtype=torch.long, device=tokens.device)


@register_method("divprune", stage="pre_llm")
class DivPrune(Method):
    """Max-min diversity on the projected image tokens. No options of its own (``keep=`` sets the count)."""

    scores_projected = True

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        if evidence.projected is None:
            raise ValueError("divprune needs the projected image tokens, which the model did not give")
        return [kept_as_selection(divprune_keep(tokens, keep)) for tokens in evidence.projected]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """The projected image tokens' N × N cosine similarity (the greedy rounds compare, they do not multiply)."""
        n = model.image_tokens
        return MethodCost.before_llm(keep, n * n * model.llm.width)
