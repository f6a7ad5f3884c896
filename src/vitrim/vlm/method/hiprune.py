"""``hiprune`` (Liu et al., 2025, "HiPrune: Training-Free Visual Token Pruning via Hierarchical Attention in Vision
Encoders"): anchors where a middle tower layer attends, their neighbours as buffers, the rest by the deep layer.

    vitrim.vlm.apply(model, "hiprune", keep=64)      # LLaVA-1.5: anchors at CLIP layer 9, registers at layer −2

As the authors' code selects (Danielement321/HiPrune, MIT; ``encode_images`` of their LLaVA ``llava_arch.py``,
the same steps in their Qwen2.5-VL forward), per image of N tokens on an R × C grid with k = ``keep``:

- the "global attention" of a layer: its softmax attention map averaged over heads and over ALL queries ([CLS]
  included), the column of each image token (the attention it receives);
- anchors: the a = round(k · alpha / 5) tokens with the most global attention at the object layer
  (``object_layer``, 1-based: the authors read ``attentions[object_layer − 1]``, layer 9 of CLIP-L's 24);
- buffers: each anchor's raster neighbours i − 1, i + 1, i − C, i + C, clamped to 0 … N − 1 (the authors' raster
  arithmetic: i − 1 of a row's first token is the previous row's last; C is 24 in their LLaVA code, here the
  tower's own grid width); anchors and buffers together, without repeats, are the set A;
- registers: the k − |A| other tokens with the most global attention at the deep layer (the one producing the
  features: LLaVA's −2; SigLIP's last).

Kept: A and the registers, in raster order. vitrim breaks ties towards the lower index (the authors' ``topk`` leaves
them to the backend), refuses a keep whose anchors and buffers could exceed it (5 · a > k; the authors' code would
fail), and at batch > 1 keeps ``keep`` per image (the authors divide their count by the batch, meant for one image's
LLaVA-NeXT tiles).

Where it runs: a tower method (:mod:`vitrim.vlm.stages.tower`). The stage captures the q and k of two tower blocks
from their own projections (the blocks' attention stays on its backend); :class:`HiPruneLayer` computes the global
attention of the object block, and at the feature block (after its attention residual: its MLP acts per token, so
the kept tokens are the authors' rows of ``hidden_states[−2]``) selects and drops; the LLM then receives the kept
tokens only (LLaVA) or the patch grid with the dropped patches zero (``to_grid``: Gemma 3, PaliGemma). A SigLIP
tower has no [CLS], and HiPrune needs none: the global attention is every query's, as on the authors' Qwen2.5-VL.
The authors tune ``object_layer`` per tower (9 of CLIP-L's 24, 16 of Qwen2.5-VL's 32); for SigLIP they give none,
and vitrim keeps 9 (pass ``object_layer`` for another).

On Qwen2-VL, Qwen2.5-VL and Qwen3-VL (whose tower vitrim does not cut) the same name runs the authors' Qwen2.5-VL
code before the LLM: the tower runs whole and the merged tokens are selected from its blocks' attention
(:mod:`vitrim.vlm.method.hiprune_qwen`: object block 16 by default, registers from the last block, ``keep=0.223``
as their retention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.attention import AttentionResult
from vitrim.reduce import Reducer, TokenState
from vitrim.vlm.method.base import register_method
from vitrim.vlm.method.cost import VLM, MethodCost, cut_tower_blocks
from vitrim.vlm.method.hiprune_qwen import HiPruneBeforeLLM, check_hiprune_options
from vitrim.vlm.method.ranking import top_k_stable
from vitrim.vlm.method.tower_ranking import received_attention
from vitrim.vlm.method.tower_reducers import TowerLayout, TowerMethod

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


def global_attention(attention: AttentionResult, num_prefix: int) -> Tensor:
    """(B, n): the attention each patch token receives, averaged over heads and over every query ([CLS] too), from
    the block's own q and k (the map is formed a few queries at a time; ``attention.mask`` is added)."""
    return received_attention(attention.q, attention.k, attention.scale, attention.mask).mean(dim=(1, 2))[
        :, num_prefix:
    ]


@dataclass
class HiPruneRun:
    """The object block's global attention (B, n), from the object block to the deep one of one forward."""

    objects: Tensor | None = None


class HiPruneLayer(Reducer):
    """HiPrune at one tower block: ``probe`` keeps its global attention as the object layer's; ``cut`` (the deep
    block) selects ``keep`` patch tokens per image from both layers' and drops the others."""

    def __init__(self, run: HiPruneRun, *, probe: bool, cut: bool, keep: int, alpha: float, side: int) -> None:
        self.run, self.probe, self.cut, self.keep_count, self.alpha, self.side = run, probe, cut, keep, alpha, side

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        if self.keep_count >= state.num_patch_tokens:
            return state  # keep = all: nothing to score (no block before the deep one drops a token)
        received = global_attention(attention, state.num_prefix)  # (B, n)
        if self.probe:
            self.run.objects = received
        if not self.cut:
            return state
        objects = self.run.objects
        if objects is None or objects.shape != received.shape:
            raise RuntimeError("hiprune's deep layer ran without its object layer in this forward pass")
        kept = torch.stack(
            [hiprune_keep(objects[b], received[b], self.side, self.keep_count, self.alpha) for b in range(len(objects))]
        )  # fmt: skip
        return self.keep(state, kept)

    def extra_repr(self) -> str:
        return f"probe={self.probe}, cut={self.cut}, keep={self.keep_count}, alpha={self.alpha}"


@register_method("hiprune", stage="tower")
class HiPrune(TowerMethod):
    """Anchors at a middle tower layer, their buffers, registers at the feature layer (module doc). Options (the
    authors' names): ``alpha`` (float in [0, 1], default 0.1: 5·alpha of ``keep`` are anchors and buffers),
    ``object_layer`` (int ≥ 1, default 9: the 1-based tower layer whose attention picks the anchors), ``keep=``
    (their ``HIPRUNE_RETENTION``: patches per image; required), and ``to_grid`` (the tower stage's). On the Qwen
    family: :class:`~vitrim.vlm.method.hiprune_qwen.HiPruneBeforeLLM` (before the LLM, ``object_layer`` 16)."""

    pre_llm_form = HiPruneBeforeLLM

    defaults: ClassVar[Mapping[str, Any]] = {
        "alpha": HIPRUNE_ALPHA, "object_layer": HIPRUNE_OBJECT_LAYER, "to_grid": None,
    }  # fmt: skip

    def check(self) -> None:
        check_hiprune_options(self.options["alpha"], self.options["object_layer"])

    def check_keep(self, keep: int) -> None:
        alpha = self.options["alpha"]
        if NEIGHBOURS * anchor_count(keep, alpha) > keep:
            raise ValueError(
                f"hiprune cannot keep {keep} tokens with alpha={alpha}: its {anchor_count(keep, alpha)} anchors and "
                f"their buffers may take {NEIGHBOURS * anchor_count(keep, alpha)} (expected 5 · round(keep · alpha "
                "/ 5) <= keep)"
            )

    def tower_reducers(self, plan: TowerLayout, keep: int | None) -> dict[int, Reducer]:
        if keep is None:
            raise ValueError("vlm method 'hiprune' needs keep= (patches per image, or a fraction in (0, 1])")
        layer = self.options["object_layer"]
        if layer > plan.depth:
            raise ValueError(
                f"object_layer={layer} is past this tower's feature layer (layer {plan.depth}, 1-based); expected "
                f"1 … {plan.depth}"
            )
        run, deep, found = HiPruneRun(), plan.depth - 1, layer - 1
        alpha = float(self.options["alpha"])
        reducers: dict[int, Reducer] = {
            found: HiPruneLayer(run, probe=True, cut=found == deep, keep=keep, alpha=alpha, side=plan.side)
        }
        if found != deep:
            reducers[deep] = HiPruneLayer(run, probe=False, cut=True, keep=keep, alpha=alpha, side=plan.side)
        return reducers

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """The tower runs whole up to the feature block's attention, ``keep`` patches and [CLS] from its MLP on,
        and ``keep`` enter the LLM; its own: the global attention (every query's row over every key, q·kᵀ) of the
        object block and the feature block (one when they are the same). The stage reads the blocks' own q, k."""
        tower = model.tower
        if tower.temporal_patch > 1:  # Qwen's tower (its Conv3d stacks frames): the pre-LLM form runs there
            return self.pre_llm_form(**{k: self.options[k] for k in self.given}).cost(
                model, keep, text_tokens=text_tokens
            )
        n, feature = tower.tokens, tower.reducing_layers - 1  # the block whose output is handed on (0-based)
        object_block = self.options["object_layer"] - 1
        own = (1 if object_block == feature else 2) * n * n * tower.width
        return MethodCost(own=own, llm_cuts=((0, keep),), tower_blocks=cut_tower_blocks(tower, feature, keep))
