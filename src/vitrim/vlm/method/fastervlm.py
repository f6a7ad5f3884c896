"""``fastervlm`` (Zhang et al., 2024, "[CLS] Attention is All You Need for Training-Free Visual Token Pruning"):
keep the ``keep`` image tokens that [CLS] attends to most, at the tower layer that produces LLaVA's features.

Score of token i (authors' code): the softmax attention of [CLS] to token i at layer ``vision_feature_layer``
(−2), averaged over heads, ``attentions[-2][:, :, 0, 1:].mean(1)``; kept: the top ``keep``. The authors call
``torch.topk``, whose order among equal scores the backend decides; vitrim breaks ties towards the lower raster
index (a stable descending sort), so the selection is the same on every device. vitrim computes the one [CLS] row
from the layer's own q/k projections (no ``output_attentions``), so the tower stays on SDPA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost, cls_row_macs


def top_indices(scores: Tensor, count: int) -> Tensor:
    """(count,) long: the indices of the ``count`` largest ``scores`` (N,), highest first, ties to the lower index."""
    return torch.sort(scores, descending=True, stable=True).indices[:count]


def kept_as_selection(kept: Tensor) -> ImageSelection:
    """An ImageSelection of plain kept tokens (no merging), sorted in raster order."""
    return ImageSelection.unmerged(kept.sort().values)


def cls_scores(evidence: VisionEvidence) -> Tensor:
    """(I, N): the [CLS] attention row averaged over heads; ``ValueError`` when the family could not give it."""
    if evidence.cls_attention is None:
        raise ValueError("this method needs the [CLS] attention row of the scoring layer, which the model did not give")
    return evidence.cls_attention.mean(1)


@register_method("fastervlm", stage="pre_llm")
class FasterVLM(Method):
    """[CLS]-attention top-k before the LLM. No options of its own (``keep=`` sets the count)."""

    needs_cls_attention = True

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        return [kept_as_selection(top_indices(scores, keep)) for scores in cls_scores(evidence)]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        return MethodCost.before_llm(keep, cls_row_macs(model.tower))  # the one [CLS] row (the top-k is no product)
