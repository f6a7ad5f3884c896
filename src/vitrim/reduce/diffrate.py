"""DiffRate (Chen et al., ICCV 2023) at inference: in each block, prune by [CLS] attention, then merge the least
attentive of the kept tokens into the most similar attentive ones, to per-block counts DiffRate searched.

Conventions, read from the authors' code (OpenGVLab/DiffRate, ``DiffRate/patch/deit.py`` ``DiffRateBlock.forward``
evaluation branch and ``DiffRateAttention``; ``DiffRate/merge.py`` ``get_merge_func``) and adopted here:

* Where: every block of ``layers`` (default every block), after the attention residual, before the MLP.
* Order: the patch tokens are ranked by the [CLS] row of the block's attention, mean over heads (descending).
* Prune: the first ``prune_kept`` tokens ([CLS] included) stay: the other patch tokens are dropped.
* Merge (when ``merge_kept`` is fewer): the kept patch tokens beyond the first ``merge_kept`` (the least attentive)
  each go to their most similar token among the first ones, by cosine similarity of the tokens themselves (x after
  the attention residual, not the keys); [CLS] never receives one. A destination becomes the plain mean of itself
  and its sources (``scatter_reduce(..., "mean")``, sizes not used), and its size grows by Σ size_src · sim_src
  (the authors' "proportional attention considering similarity"; sizes are not clamped in their evaluation path).
* Counts: ``prune_kept`` / ``merge_kept`` are tokens *including* the prefix, one per block of ``layers`` (or one for
  all), as in DiffRate's ``compression_rate.json``; a count at or above the tokens present does nothing. The DiffRate
  presets (:mod:`vitrim.reduce.schedule`) give them with ``schedule="diffrate_deit_s_2.9"``.
* Proportional attention: on (the authors' attention always adds log(size)). Counts are static, so a model with it
  exports to ONNX (tested with merging).
* Layout: [prefix, the first merge_kept − prefix patch tokens in descending [CLS] attention]. DiffRate also reorders
  blocks that reduce nothing; here they are left alone (the same outputs: attention does not see order).
* Protected: every prefix token; the authors protect [CLS] (a DeiT distillation token would be pruned there).
* Provenance: pruning appends ``kept_indices`` and a ``patch_to_token`` map; merging appends another map (as ToMe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrim.attention import AttentionResult
from vitrim.reduce.base import Reducer
from vitrim.reduce.cls_ranking import cls_attention_to_patches, per_layer
from vitrim.reduce.registry import register
from vitrim.reduce.schedule import Schedule
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import add_rows_, record_reduction


def merge_into_attentive(x: Tensor, sizes: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Merge patch tokens k … of ``x`` (B, m, C) into their most similar one among the first k (DiffRate's merge).

    sizes: (B, m). Returns tokens (B, k, C) (plain mean of a destination and its sources), sizes (B, k) (grown by
    Σ size · similarity) and dest (B, m − k): where each source went.
    """
    with torch.no_grad():
        metric = F.normalize(x, dim=-1)
        sim = metric[:, k:] @ metric[:, :k].transpose(1, 2)  # (B, m − k, k) cosine
        node_max, dest = sim.max(dim=-1)  # (B, m − k)
    out = x[:, :k].clone()  # (B, k, C)
    add_rows_(out, dest, x[:, k:])
    count = torch.ones_like(sizes[:, :k]).scatter_add(1, dest, torch.ones_like(sizes[:, k:]))  # (B, k)
    out = out / count[..., None].to(out.dtype)
    merged_sizes = sizes[:, :k].scatter_add(1, dest, sizes[:, k:] * node_max.to(sizes.dtype))  # (B, k)
    return out, merged_sizes, dest


@register("diffrate")
class DiffRate(Reducer):
    """Prune to ``prune_kept`` tokens by [CLS] attention, then merge to ``merge_kept`` (see module doc)."""

    needs_cls_token = True
    example_options: ClassVar[dict[str, Any]] = {"prune_kept": [17, 15, 12, 9], "merge_kept": [17, 13, 10, 8]}
    identity_options: ClassVar[dict[str, Any]] = {"prune_kept": 10_000, "merge_kept": 10_000}

    def __init__(self, prune_kept: int, merge_kept: int) -> None:
        for name, value in (("prune_kept", prune_kept), ("merge_kept", merge_kept)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (tokens kept, prefix included), got {value!r}")
        self.prune_kept = prune_kept
        self.merge_kept = merge_kept

    @classmethod
    def for_layers(  # type: ignore[override]  # a reducer takes its own options; apply checks their names
        cls, layers: tuple[int, ...], *, prune_kept: int | Sequence[int], merge_kept: int | Sequence[int]
    ) -> dict[int, Reducer | None]:
        prunes = per_layer("prune_kept", prune_kept, layers)
        merges = per_layer("merge_kept", merge_kept, layers)
        return {layer: cls(p, m) for layer, p, m in zip(layers, prunes, merges)}

    @classmethod
    def options_for_schedule(cls, schedule: Schedule) -> tuple[tuple[int, ...], dict[str, Any]]:
        """Every block, with DiffRate's own counts."""
        return tuple(range(schedule.depth)), {
            "prune_kept": list(schedule.prune_kept),
            "merge_kept": list(schedule.merge_kept),
        }

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        n, p = state.num_patch_tokens, state.num_prefix
        pruned = max(0, min(n, self.prune_kept - p))  # patch tokens after pruning
        merged = max(0, min(pruned, self.merge_kept - p))  # … and after merging
        if merged >= n:
            return state
        if state.keep_policy is not None:
            raise ValueError("DiffRate cannot follow a training-time keep_policy (DynamicViT training); got one")
        # argsort as the authors' torch.sort (not stable): it exports to ONNX
        order = cls_attention_to_patches(attention, p).argsort(dim=1, descending=True)  # (B, n) most attended first
        state = self.keep(state, order[:, :pruned])
        if merged == pruned:
            return state
        if merged < 1:
            raise ValueError(f"merge_kept={self.merge_kept} leaves no patch token to merge into ({p} prefix tokens)")
        x = state.tokens  # (B, p + pruned, C)
        B = x.shape[0]
        sizes = state.sizes if state.sizes is not None else x.new_ones(B, x.shape[1])
        patches, patch_sizes, dest = merge_into_attentive(x[:, p:], sizes[:, p:], merged)
        kept = torch.arange(merged, device=x.device).expand(B, merged)
        return state.replace(
            tokens=torch.cat([x[:, :p], patches], dim=1),
            positions=None if state.positions is None else state.positions[:, :merged],
            fused=None if state.fused is None else state.fused[:, :merged],
            sizes=torch.cat([sizes[:, :p], patch_sizes], dim=1),
            size_bias=True,
            patch_to_token=record_reduction(state, torch.cat([kept, dest], dim=1)),
        )

    def extra_repr(self) -> str:
        return f"prune_kept={self.prune_kept}, merge_kept={self.merge_kept}"
