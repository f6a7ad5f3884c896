"""``hiprune`` on Qwen2-VL, Qwen2.5-VL and Qwen3-VL: its authors' Qwen2.5-VL code, before the LLM.

Qwen's tower packs every image into one sequence and its merger reads each 2×2 patch group whole, so vitrim cuts
nothing inside it (the family refuses tower methods); HiPrune's authors did not either. Their released Qwen2.5-VL
path (Danielement321/HiPrune, MIT; ``Qwen2_5_VL/qwen2_5_vl_HiPrune.py``: the vision forward's ``attn_list`` and the
``##### HiPrune #####`` block of ``Qwen2_5_VLForConditionalGeneration.forward``) runs the tower whole, then before
the LLM, per image of N merged tokens on an R × C token grid (C = grid width / merge):

- each block's "global attention" per merged token: its softmax map averaged over heads, summed over the queries,
  averaged over the token's m² patches, in raster order (:mod:`vitrim.vlm.evidence.global_attention`);
- k = round(N · retention) tokens kept (their ``HIPRUNE_QWEN_RETENTION``, 0.223 in their script: ``keep=0.223``);
- a = round(k · alpha / 5) anchors: the top a of the object block (``object_layer``, 1-based: their
  ``attn_list[OBJECT_LAYER − 1]``, 16 in their script); buffers i ± 1, i ± C, clamped to 0 … N − 1, without repeats:
  the set A;
- registers: the top k − |A| of the LAST block's global attention minus 1 on A (their ``deep_attention -=
  available_index_mask``): an anchored token whose deep score passes 1 plus the k − |A|-th other can be taken
  again, and the image then keeps fewer than k tokens, as theirs does;
- kept: A and the registers, in raster order, at their M-RoPE positions (the LLM input keeps the full prompt's
  positions at the kept tokens, as their code slices ``position_ids``).

Where vitrim differs from the authors, and why: per image (their code is batch 1: one top-k over every image
token of the batch, C from the first image); ties to the lower index (their ``topk`` leaves them to the kernel);
the attention map within each block's own segments (their eager and SDPA attention; their flash-attention path's
map ignores the segments, which in a full-attention block - 16 and 32 of Qwen2.5-VL's 32 are - only matters for
several images in one call).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.vlm.evidence.global_attention import authors_global_attention
from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence
from vitrim.vlm.method.cost import VLM, MethodCost
from vitrim.vlm.method.fastervlm import kept_as_selection
from vitrim.vlm.method.ranking import top_k_stable

HIPRUNE_QWEN_OBJECT_LAYER = 16  # the authors' bench_qwen script (of Qwen2.5-VL's 32 blocks)
NEIGHBOURS = 5  # an anchor and its 4 raster neighbours


def check_hiprune_options(alpha: Any, layer: Any) -> None:
    """HiPrune's options, one line naming the bad one (both forms: the tower method and this one)."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha!r} must be a number in [0, 1]")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
        raise ValueError(f"object_layer={layer!r} must be an int >= 1 (1-based, as the authors count)")


def hiprune_qwen_keep(objects: Tensor, deep: Tensor, width: int, keep: int, alpha: float) -> Tensor:
    """(≤ keep,) long, ascending: the authors' Qwen HiPrune selection of one image.

    objects, deep: (N,) the global attention (authors' scale) of the object block and of the last block; width:
    the token grid's columns C.
    """
    num_tokens = objects.shape[0]
    anchors = top_k_stable(objects, round(keep * alpha / NEIGHBOURS))
    offsets = torch.tensor([0, -1, 1, -width, width], device=objects.device)
    anchored = torch.zeros(num_tokens, dtype=torch.bool, device=objects.device)
    anchored[(anchors[None, :] + offsets[:, None]).clamp(0, num_tokens - 1).flatten()] = True
    registers = top_k_stable(deep - anchored.to(deep.dtype), keep - int(anchored.sum()))
    kept = anchored.clone()
    kept[registers] = True
    return kept.nonzero().flatten()


class HiPruneBeforeLLM(Method):
    """HiPrune's pre-LLM form (module doc), what ``vitrim.vlm.apply(model, "hiprune", keep=0.223)`` runs on a Qwen
    model. Options as the tower method's: ``alpha`` (default 0.1), ``object_layer`` (1-based tower block, default 16
    as the authors' Qwen2.5-VL script), ``to_grid`` (the tower stage's; None here)."""

    name = "hiprune"
    stage = "pre_llm"
    defaults: ClassVar[Mapping[str, Any]] = {
        "alpha": 0.1, "object_layer": HIPRUNE_QWEN_OBJECT_LAYER, "to_grid": None,
    }  # fmt: skip
    needs_cls_attention = True  # the family taps the last block (the scoring block) and ``object_block``

    def check(self) -> None:
        check_hiprune_options(self.options["alpha"], self.options["object_layer"])
        if self.options["to_grid"] is not None:
            raise ValueError("to_grid is the tower stage's; hiprune runs before the LLM on this family")

    @property
    def object_block(self) -> int:
        """The 0-based tower block whose attention picks the anchors."""
        return int(self.options["object_layer"]) - 1

    def check_keep(self, keep: int) -> None:
        alpha = self.options["alpha"]
        if NEIGHBOURS * round(keep * alpha / NEIGHBOURS) > keep:
            raise ValueError(
                f"hiprune cannot keep {keep} tokens with alpha={alpha}: its anchors and their buffers may take more "
                "(expected 5 · round(keep · alpha / 5) <= keep)"
            )

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        if evidence.cls_attention is None or evidence.object_attention is None:
            raise ValueError("hiprune needs the tower's object-block and last-block attention, which were not tapped")
        self.check_keep(keep)
        _, width = evidence.token_grid()
        alpha = float(self.options["alpha"])
        return [
            kept_as_selection(
                hiprune_qwen_keep(authors_global_attention(objects), authors_global_attention(deep), width, keep, alpha)
            )
            for objects, deep in zip(evidence.object_attention, evidence.cls_attention, strict=True)
        ]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """The tower runs whole and ``keep`` merged tokens enter the LLM; its own: the global attention (every
        query's row over the keys of its segment, q·kᵀ: the image in a full-attention block, its window in the
        others) of the object block and of the last block, from their q and k."""
        tower = model.tower
        own = 0
        for block in sorted({self.object_block, tower.layers - 1}):
            windowed = tower.window is not None and block not in tower.full_attention_layers
            own += tower.tokens * (tower.window if windowed and tower.window else tower.tokens) * tower.width
        return MethodCost.before_llm(keep, own)
