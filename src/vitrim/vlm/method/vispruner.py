"""``vispruner`` (Zhang et al., 2025, "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token
Pruning in VLMs"): important tokens by [CLS] attention, then diverse tokens by removing near-duplicates of the rest.

As the authors' code selects, per image with ``keep`` = T tokens:

1. ``important = int(T · important_ratio)`` tokens with the highest head-averaged [CLS] attention (at the layer
   that produces the features, −2 for LLaVA-1.5); the others, in descending attention order, are the residual;
2. while the residual has more than ``T − important`` tokens: split it alternately into a = residual[0::2] and
   b = residual[1::2], score each a-token by its highest cosine similarity to a b-token (on the tower features
   entering the projector), drop the ``r = min(8, excess)`` highest-scoring a-tokens, and continue with the
   remaining a-tokens (in descending score order) followed by the b-tokens.

The kept tokens are the important and the residual ones, in raster order. The authors sort with
``argsort(descending=True)``, which leaves the order of equal values to the backend; vitrim breaks ties towards
the earlier position (a stable sort). With ``important_ratio=1`` no diverse tokens are kept (the authors' loop
would fail on an empty b-half).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost, cls_row_macs
from vitrim.vlm.method.fastervlm import cls_scores, kept_as_selection

DROP_PER_ROUND = 8  # the authors' fixed number of near-duplicates removed per round


def vispruner_keep(scores: Tensor, features: Tensor, keep: int, important_ratio: float) -> Tensor:
    """(keep,) long, unsorted: VisPruner's kept indices for one image. scores: (N,); features: (N, D)."""
    important = int(keep * important_ratio)
    diverse = keep - important
    order = torch.sort(scores, descending=True, stable=True).indices  # (N,)
    important_indices, residual = order[:important], order[important:]
    if diverse == 0:
        return important_indices
    normalized = features / features.norm(dim=-1, keepdim=True)  # (N, D)
    cosine = normalized @ normalized.T  # (N, N) once; each round reads its a × b block (the authors recompute it)
    while True:
        drop = min(DROP_PER_ROUND, len(residual) - diverse)
        if drop <= 0:
            break
        a, b = residual[0::2], residual[1::2]  # (⌈R/2⌉,), (⌊R/2⌋,)
        similarity = cosine[a][:, b].max(-1).values  # (⌈R/2⌉,)
        distinct = torch.sort(similarity, descending=True, stable=True).indices[drop:]
        residual = torch.cat([a[distinct], b])
    return torch.cat([important_indices, residual])


@register_method("vispruner", stage="pre_llm")
class VisPruner(Method):
    """Options: ``important_ratio`` (float in [0, 1], default 0.5: the share of ``keep`` chosen by [CLS] attention)."""

    defaults: ClassVar[Mapping[str, Any]] = {"important_ratio": 0.5}
    needs_cls_attention = True

    def check(self) -> None:
        ratio = self.options["important_ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"important_ratio={ratio!r} must be a number in [0, 1]")

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        ratio = float(self.options["important_ratio"])
        return [
            kept_as_selection(vispruner_keep(scores, features, keep, ratio))
            for scores, features in zip(cls_scores(evidence), evidence.features)
        ]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """The [CLS] row, then the authors' rounds: half of ``keep`` by score; the rest split in halves a, b whose
        cosines (of the features) are compared, the 8 a-tokens nearest to b dropped, until ``keep - keep // 2``
        remain."""
        n, d = model.image_tokens, model.tower.width
        diverse, rest, similarities = keep - keep // 2, n - keep // 2, 0
        while rest > diverse and diverse > 0:
            similarities += ((rest + 1) // 2) * (rest // 2) * d
            rest -= min(8, rest - diverse)
        return MethodCost.before_llm(keep, cls_row_macs(model.tower) + similarities)
