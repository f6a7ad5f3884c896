"""FlowCut (Tong et al., NeurIPS 2025, "FlowCut: Rethinking Redundancy via Information Flow for Efficient
Vision-Language Models"): inside the CLIP tower, every second layer, drop the patches with the least accumulated
information flow, as many as the [CLS] attention's entropy allows, down to ``target`` at the feature layer.

Not a registered method yet: it cuts inside the tower, between layers, with per-layer evidence (the [CLS] row, the
[CLS] value's attention over the values, the values' norms) that vitrim's tower stage does not capture; what is
here is its selection as pure functions of those tensors, for that stage to call.

As the authors' code selects (TungChintao/FlowCut, Apache-2.0; ``CLIPEncoderLayer_forward`` and
``utils_flowcut.py``), for one image with L tower layers and the feature layer −2 (``select_layer = L − 2``), after
layer l (0-based) while the image has more than ``target`` patches:

1. score_i = (a_i / Σ a + s_i / Σ s) · ‖v_i‖₁ over its N patches: a the [CLS] attention row averaged over heads,
   s the softmax of [CLS]'s value against every value (per head, then averaged over heads), v the values averaged
   over heads (all at layer l, on its current tokens);
2. cumulative = score at the first such layer, else 0.5 · cumulative + 0.5 · score (the kept patches' own);
3. with ``remaining`` = L − 2 − l − 1 even (every second layer; 0 at the layer before the feature layer), keep the
   top-n by cumulative, n = max(N − prune, target), prune = round((N − target) / √remaining · (1 − H²)), H the
   entropy of a / Σ a divided by log N (a peaked [CLS] row prunes more); at remaining 0, n = target.

Where vitrim differs (and why): **the count is the image's own.** The authors' batched code takes the largest
prune over the batch (``r.max(0)``), so an image kept a different number of patches, and different patches, with
other images beside it; :func:`flowcut_step` is one image's step, so an image selects the same alone or in a batch
(at batch 1 the two are the same). Ties go to the lower index (the authors' ``topk`` leaves them to the backend);
log N is taken in float64 (the authors' ``torch.log(torch.tensor(N))`` is float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from vitrim.vlm.method.ranking import top_k_stable


def remaining_layers(num_layers: int, layer: int, feature_layer: int = -2) -> int:
    """The authors' ``remain_prune_layer`` after 0-based tower layer ``layer``: (L + feature_layer) − layer − 1."""
    return num_layers + feature_layer - layer - 1


def flowcut_count(cls_attention: Tensor, remaining: int, target: int) -> int:
    """Patches kept by a pruning step: cls_attention (N,) the [CLS] row over the N patches; ``target`` patches."""
    num = cls_attention.shape[0]
    if remaining == 0:
        return target
    prob = cls_attention / cls_attention.sum()
    entropy_ratio = float(-(prob * torch.log(prob)).sum()) / math.log(num)
    prune = (num - target) / math.sqrt(remaining) * (1 - entropy_ratio**2)
    return max(num - int(torch.tensor(prune).round()), target)  # torch's round: halves to even, as the authors'


@dataclass(frozen=True)
class FlowCutStep:
    """After one layer: ``kept`` (n,) ascending positions among the image's current N patches, and the cumulative
    score (n,) of the kept ones (the next step's ``cumulative``)."""

    kept: Tensor
    cumulative: Tensor


def flowcut_step(
    cls_attention: Tensor,
    semantic_attention: Tensor,
    value_l1: Tensor,
    cumulative: Tensor | None,
    remaining: int,
    target: int,
) -> FlowCutStep:
    """One image's FlowCut step after a tower layer (module docstring).

    cls_attention: (N,) a; semantic_attention: (N,) s; value_l1: (N,) ‖v_i‖₁; cumulative: (N,) or None at the first
    scoring layer; remaining: the layers left (:func:`remaining_layers`); target: patches at the feature layer.
    """
    num = cls_attention.shape[0]
    everything = torch.arange(num, device=cls_attention.device)
    if num <= target:
        return FlowCutStep(everything, cumulative if cumulative is not None else cls_attention.new_zeros(num))
    score = (cls_attention / cls_attention.sum() + semantic_attention / semantic_attention.sum()) * value_l1
    cumulative = score if cumulative is None else 0.5 * cumulative + 0.5 * score
    if remaining % 2:
        return FlowCutStep(everything, cumulative)
    kept = top_k_stable(cumulative, flowcut_count(cls_attention, remaining, target))
    return FlowCutStep(kept, cumulative[kept])
