"""FlowCut (Tong et al., NeurIPS 2025, "FlowCut: Rethinking Redundancy via Information Flow for Efficient
Vision-Language Models"): inside the CLIP tower, every second layer, drop the patches with the least accumulated
information flow, as many as the [CLS] attention's entropy allows, down to ``keep`` at the feature layer.

    vitrim.vlm.apply(model, "flowcut", keep=64)      # LLaVA-1.5: 64 patches reach the feature layer and the LLM

A tower method (:mod:`vitrim.vlm.stages.tower`): one :class:`FlowCutLayer` on each tower block before the feature
layer's, reading the block's own q, k and v (the stage captures them from the block's projections; the block's
attention stays on its backend). It needs [CLS] (its query row and its value are the signal): a SigLIP tower
(Gemma 3, PaliGemma) is refused.

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

The authors cut after the layer's MLP; vitrim cuts after its attention residual, before the MLP (the seam every
tower reducer uses). The MLP acts on each token alone, so the kept tokens are the same numbers either way.

Where vitrim differs (and why): **the count is the image's own.** The authors' batched code takes the largest
prune over the batch (``r.max(0)``), so an image kept a different number of patches, and different patches, with
other images beside it; :func:`flowcut_step` is one image's step, so an image selects the same alone or in a batch
(at batch 1 the two are the same). In a batch the images then hold different numbers of tokens between the cuts:
the shorter ones are padded to the longest with tokens of size 0, whose log-size (−inf) the stage adds to the
attention logits, so no real token attends to a pad (:func:`keep_ragged`); at the feature layer every image has
exactly ``keep`` and no pad is left. Ties go to the lower index (the authors' ``topk`` leaves them to the backend);
log N is taken in float64 (the authors' ``torch.log(torch.tensor(N))`` is float32). The authors' anyres path
(LLaVA-NeXT: half the target per tile) is not offered: vitrim's tower stage does not run tiled towers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.attention import AttentionResult
from vitrim.reduce import Reducer, TokenState
from vitrim.reduce.tokens import record_reduction, take_rows, with_prefix
from vitrim.vlm.method.base import register_method
from vitrim.vlm.method.cost import VLM, MethodCost, cut_tower_blocks
from vitrim.vlm.method.ranking import top_k_stable
from vitrim.vlm.method.tower_reducers import TowerLayout, TowerMethod


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


@dataclass
class FlowCutRun:
    """What one tower forward carries from block to block: each image's cumulative score (None before the first)."""

    cumulative: list[Tensor | None] = field(default_factory=list)


class FlowCutLayer(Reducer):
    """FlowCut's step after one tower block (module doc), on every image of the batch, each with its own count.

    remaining: :func:`remaining_layers` of this block; target: patches at the feature layer; run: shared by the
    blocks of one tower (the first block, ``first``, starts it afresh on each forward)."""

    def __init__(self, remaining: int, target: int, run: FlowCutRun, first: bool) -> None:
        self.remaining, self.target, self.run, self.first = remaining, target, run, first

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        p = state.num_prefix
        batch, n = state.tokens.shape[0], state.num_patch_tokens
        counts = [n] * batch if state.sizes is None else (state.sizes[:, p:] > 0).sum(1).tolist()
        if self.first:
            self.run.cumulative = [None] * batch
        if max(counts) <= self.target:
            return state
        a, s, l1 = flow_signals(attention, p)  # (B, n) each; a pad's a and s are 0
        kept = []
        for image, count in enumerate(counts):
            step = flowcut_step(
                a[image, :count], s[image, :count], l1[image, :count], self.run.cumulative[image], self.remaining,
                self.target,
            )  # fmt: skip
            self.run.cumulative[image] = step.cumulative
            kept.append(step.kept)
        if all(len(k) == count for k, count in zip(kept, counts)):
            return state  # no cut at this block (an odd remaining count, or nothing to prune)
        return keep_ragged(state, kept)

    def extra_repr(self) -> str:
        return f"remaining={self.remaining}, target={self.target}"


def flow_signals(attention: AttentionResult, num_prefix: int) -> tuple[Tensor, Tensor, Tensor]:
    """FlowCut's three signals of a block, each (B, n) over the patch tokens: the [CLS] attention row averaged over
    heads (a), [CLS]'s value attention softmax(v_cls · vᵀ) averaged over heads (s, no scale, as the authors' code),
    and ‖mean over heads of v‖₁. ``attention.mask`` (the stage's log-sizes: −inf on a pad) is added to both logits,
    so a pad gets exactly 0 of a and s. Half precision is scored in float32."""
    if attention.v is None:
        raise RuntimeError("flowcut needs the block's values; the tower stage captured none")
    work = torch.promote_types(attention.q.dtype, torch.float32)
    q, k, v = (t.to(work) for t in (attention.q, attention.k, attention.v))  # (B, H, N, hd)
    cls_logits = q[:, :, :1] @ k.transpose(-1, -2) * attention.scale  # (B, H, 1, N)
    value_logits = v[:, :, :1] @ v.transpose(-1, -2)  # (B, H, 1, N)
    if attention.mask is not None:
        bias = attention.mask.to(work)
        cls_logits, value_logits = cls_logits + bias, value_logits + bias
    a = cls_logits.softmax(-1).mean(1)[:, 0, num_prefix:]
    s = value_logits.softmax(-1).mean(1)[:, 0, num_prefix:]
    l1 = v.mean(1)[:, num_prefix:].abs().sum(-1)
    return a, s, l1


def keep_ragged(state: TokenState, kept: list[Tensor]) -> TokenState:
    """The state with image b's prefix and its patch tokens ``kept[b]`` (ascending indices among its current ones),
    every image padded to the longest with copies of its last kept token of size 0 (a −inf log-size on their keys:
    nothing attends to them); sizes are None again when no image needs a pad. Positions and ``patch_to_token``
    follow the kept tokens (no patch maps to a pad)."""
    p = state.num_prefix
    longest = max(len(k) for k in kept)
    index = torch.stack([torch.cat([k, k[-1:].expand(longest - len(k))]) for k in kept])  # (B, longest)
    real = torch.stack([torch.arange(longest, device=index.device) < len(k) for k in kept])  # (B, longest)
    tokens = take_rows(state.tokens, with_prefix(index, p))
    positions = None if state.positions is None else state.positions.gather(1, index)
    sizes = None
    if not bool(real.all()):
        sizes = torch.cat([real.new_ones(len(kept), p), real], 1).to(state.tokens.dtype)
    dest = torch.full((len(kept), state.num_patch_tokens), -1, dtype=torch.long, device=index.device)
    for image, k in enumerate(kept):
        dest[image, k] = torch.arange(len(k), device=index.device)
    return state.replace(tokens=tokens, positions=positions, sizes=sizes, patch_to_token=record_reduction(state, dest))


@register_method("flowcut", stage="tower")
class FlowCut(TowerMethod):
    """FlowCut in a CLIP tower (LLaVA-1.5): every second block, the patches with the least accumulated information
    flow go, as many as the [CLS] row's entropy allows, down to ``keep`` at the feature layer (module doc). Options:
    ``keep=`` (the authors' ``target_num``: patches reaching the feature layer, [CLS] not counted; required), and
    ``to_grid`` (the tower stage's)."""

    defaults: ClassVar[dict[str, Any]] = {"to_grid": None}

    def tower_reducers(self, plan: TowerLayout, keep: int | None) -> dict[int, Reducer]:
        if keep is None:
            raise ValueError("vlm method 'flowcut' needs keep= (patches per image at the feature layer)")
        if not plan.num_prefix:
            raise ValueError(
                "flowcut scores by the [CLS] token's attention row and value; this tower (SigLIP) has no [CLS]"
            )
        if plan.depth < 2:
            raise ValueError("flowcut cuts after the blocks before the feature layer's; this tower has none")
        run = FlowCutRun()
        feature_index = plan.depth - 1  # the authors' select_layer: the block whose output is handed on
        return {
            block: FlowCutLayer(feature_index - block - 1, keep, run, first=block == 0)
            for block in range(feature_index)
        }

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """An upper bound: counted as if only its last cut, after the block before the feature block's attention,
        pruned (its earlier cuts follow each image's [CLS] entropy); ``keep`` enter the LLM. Its own: in each block
        before the feature block, [CLS]'s attention row (q_cls·kᵀ) and value row (v_cls·vᵀ), on every token."""
        tower = model.tower
        feature = tower.reducing_layers - 1
        if feature < 1:  # as tower_reducers() refuses it
            raise ValueError(f"flowcut cuts after the blocks before the feature layer's; {tower.name} has none")
        own = feature * 2 * tower.tokens * tower.width
        return MethodCost(own=own, llm_cuts=((0, keep),), tower_blocks=cut_tower_blocks(tower, feature - 1, keep))
