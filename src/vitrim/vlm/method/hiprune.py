"""``hiprune`` (Liu et al., 2025, "HiPrune: Training-Free Visual Token Pruning via Hierarchical Attention in Vision
Encoders"): anchors where a middle tower layer attends, their neighbours as buffers, the rest by the last layer.

As the authors' code selects (Danielement321/HiPrune, MIT; ``encode_images`` of their LLaVA ``llava_arch.py``,
the same steps in their Qwen2.5-VL forward), per image of N tokens on an R × C grid with k = ``keep``:

- the "global attention" of a layer: its softmax attention map averaged over heads and over ALL queries ([CLS]
  included), the column of each image token (the attention it receives);
- anchors: the a = round(k · alpha / 5) tokens with the most global attention at the object layer
  (``object_layer``, 1-based: the authors read ``attentions[object_layer − 1]``, layer 9 of CLIP-L's 24);
- buffers: each anchor's raster neighbours i − 1, i + 1, i − C, i + C, clamped to 0 … N − 1 (the authors' raster
  arithmetic: i − 1 of a row's first token is the previous row's last; C = 24 for LLaVA-1.5, the merged grid's
  width for Qwen); anchors and buffers together, without repeats, are the set A;
- registers: the k − |A| other tokens with the most global attention at the deep layer (the one producing the
  features: LLaVA's −2, Qwen's last block).

Kept: A and the registers, in raster order. vitrim breaks ties towards the lower index (the authors' ``topk`` leaves
them to the backend), refuses a keep whose anchors and buffers could exceed it (5 · a > k; the authors' code would
fail), and at batch > 1 keeps ``keep`` per image (the authors divide their count by the batch, meant for one image's
LLaVA-NeXT tiles).

The evidence this needs is not in vitrim's :class:`VisionEvidence` yet: a method receives the [CLS] row (LLaVA) or
the received attention (Qwen, Gemma 3) of the scoring layer only. :func:`hiprune_keep` is the selection on plain
tensors; ``apply`` refuses the method until the pre-LLM stage hands it both layers' global attention (the
plumbing is in the :class:`HiPrune` docstring).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.vlm.method.base import Method, register_method
from vitrim.vlm.method.ranking import top_k_stable

HIPRUNE_ALPHA = 0.1  # the authors' scripts (bench_llava.sh, bench_qwen.sh)
HIPRUNE_OBJECT_LAYER = 9  # LLaVA-1.5's CLIP-L (the authors' Qwen2.5-VL script: 16)
NEIGHBOURS = 5  # an anchor and its 4 raster neighbours


def anchor_count(keep: int, alpha: float) -> int:
    """a = round(keep · alpha / 5), Python's round as the authors call it (halves to even)."""
    return round(keep * alpha / NEIGHBOURS)


def hiprune_keep(object_attention: Tensor, deep_attention: Tensor, width: int, keep: int, alpha: float) -> Tensor:
    """(keep,) long, ascending: HiPrune's kept tokens of one image.

    object_attention, deep_attention: (N,) the global attention each token receives at the object layer and at
    the deep layer; width: the grid's columns C (the raster stride of the vertical neighbours).
    """
    if NEIGHBOURS * anchor_count(keep, alpha) > keep:
        raise ValueError(
            f"hiprune cannot keep {keep} tokens with alpha={alpha}: its {anchor_count(keep, alpha)} anchors and "
            f"their buffers may take {NEIGHBOURS * anchor_count(keep, alpha)} (expected 5 · round(keep · alpha / 5) "
            "<= keep)"
        )
    num_tokens = object_attention.shape[0]
    anchors = torch.sort(object_attention, descending=True, stable=True).indices[: anchor_count(keep, alpha)]
    offsets = torch.tensor([0, -1, 1, -width, width], device=anchors.device)
    anchored = torch.zeros(num_tokens, dtype=torch.bool, device=object_attention.device)
    anchored[(anchors[None, :] + offsets[:, None]).clamp(0, num_tokens - 1).flatten()] = True
    registers = top_k_stable(deep_attention.masked_fill(anchored, -torch.inf), keep - int(anchored.sum()))
    kept = anchored.clone()
    kept[registers] = True
    return kept.nonzero().flatten()


@register_method("hiprune", stage="pre_llm")
class HiPrune(Method):
    """Anchors at a middle tower layer, their buffers, registers at the last. Options (the authors' names):
    ``alpha`` (float in [0, 1], default 0.1: 5·alpha of ``keep`` are anchors and buffers), ``object_layer``
    (int ≥ 1, default 9: the 1-based tower layer whose attention picks the anchors).

    Plumbing the pre-LLM stage must add first (until then ``apply`` refuses the method, naming it): per image,
    the global attention (mean over heads and all queries of the softmax map, the image tokens' columns, (I, N))
    at tower layer ``object_layer`` and at the scoring layer (LLaVA: the layer producing ``vision_feature_layer``;
    Qwen: the last block, per merged token summed over its m² patches as the received attention is now), e.g. as
    ``VisionEvidence.layer_attention: dict[int, Tensor]``, and the grid width (``VisionEvidence.grid``) on Qwen;
    then ``check`` stops refusing and ``select`` is ``hiprune_keep(object, deep, columns, keep, alpha)`` per image.
    """

    defaults: ClassVar[Mapping[str, Any]] = {"alpha": HIPRUNE_ALPHA, "object_layer": HIPRUNE_OBJECT_LAYER}

    def check(self) -> None:
        alpha, layer = self.options["alpha"], self.options["object_layer"]
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
            raise ValueError(f"alpha={alpha!r} must be a number in [0, 1]")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
            raise ValueError(f"object_layer={layer!r} must be an int >= 1 (1-based, as the authors count)")
        raise ValueError(
            "hiprune needs the attention of tower layer object_layer and of the scoring layer, which vitrim's "
            "pre-LLM stage does not hand to a method yet (hiprune_keep is the selection on those tensors)"
        )
