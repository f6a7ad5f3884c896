"""DiffRate (Chen et al., ICCV 2023) at inference: in each block, prune by [CLS] attention, then merge the least
attentive of the kept tokens into the most similar attentive ones, to per-block counts DiffRate searched.

Conventions, read from the authors' code (OpenGVLab/DiffRate, ``DiffRate/patch/deit.py`` ``DiffRateBlock.forward``
evaluation branch and ``DiffRateAttention``; ``DiffRate/merge.py`` ``get_merge_func``) and adopted here:

* Where: every block of ``layers`` (default every block), after the attention residual, before the MLP.
* Order: the patch tokens are ranked by the [CLS] row of the block's attention, mean over heads (descending; one
  top-k, the authors' full sort is not needed).
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
from torch import Tensor, nn

from vitrim.attention import AttentionResult
from vitrim.reduce.base import Reducer
from vitrim.reduce.cls_ranking import per_layer, ranking_scores
from vitrim.reduce.index_cache import cached, cached_eye
from vitrim.reduce.registry import register
from vitrim.reduce.schedule import Schedule
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import add_rows_, keep_rows, record_reduction, single_image


def _merge_pairs(
    num_tokens: int, num_prefix: int, k: int, width: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """(M, M) added to the similarities of M = p + m tokens in attention order (p prefix tokens, the k most attended,
    the m − k others): a source row (one of the m − k) may reach the k most attended, nothing else; every other row
    only itself, where the 0 leaves its maximum at +width (the self-similarity of a unit vector times width)."""
    i = torch.arange(num_tokens, device=device)
    source = i >= num_prefix + k
    destination = (i >= num_prefix) & ~source
    allowed = torch.where(source[:, None], destination[None, :], i[:, None] == i[None, :])
    return torch.zeros(num_tokens, num_tokens, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


@torch.no_grad()
def merge_destinations(x: Tensor, num_prefix: int, k: int) -> tuple[Tensor, Tensor]:
    """For tokens x (B, M, C) in attention order (prefix first): dest (B, M) long, the most cosine-similar of the k
    most attended patch tokens for each of the others, every prefix token and each of those k itself; and sim (B, M)
    float, that cosine similarity (1 for a token that stays itself)."""
    M, C = x.shape[1], x.shape[2]
    unit = F.rms_norm(x, (C,), eps=torch.finfo(x.dtype).tiny)  # x / ‖x‖ · √C
    bias = cached(
        ("diffrate_pairs", M, num_prefix, k, C, x.dtype, x.device),
        lambda: _merge_pairs(M, num_prefix, k, C, x.dtype, x.device),
    )
    best, dest = torch.baddbmm(bias, unit, unit.mT).max(dim=-1)  # C · cosine; a token that stays: C · 1
    return dest, best


def merge_into_attentive(x: Tensor, sizes: Tensor | None, num_prefix: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Merge the patch tokens of ``x`` (B, M, C) (attention order, prefix first) beyond the k most attended into
    their most similar of those k (DiffRate's merge): tokens (B, p + k, C), each the plain mean of itself and its
    sources; sizes (B, p + k), grown by Σ size · similarity (sizes None: ones); dest (B, M): where each token went.

    At batch 1 (eager), in few calls: the similarities of every token at once (:func:`merge_destinations`) and one
    assignment product for both sums (as :func:`vitrim.reduce.tokens.merge_rows`), at the cost of M² multiply-adds
    per channel instead of (M − p − k)·k. Above it, only the sources' similarities, and rows moved.
    """
    B, M, C = x.shape
    K = num_prefix + k
    if single_image(x):
        dest, scaled_sim = merge_destinations(x, num_prefix, k)  # (1, M), C · cosine
        assign = F.embedding(dest, cached_eye(K, dtype=x.dtype, device=x.device))  # (1, M, K)
        count = assign.sum(dim=1)  # (1, K)
        tokens = torch.einsum("bmk,bmc,bk->bkc", assign, x, count.reciprocal())
        per_width = cached(("inverse", C, x.dtype, x.device), lambda: x.new_tensor(1.0 / C))
        if sizes is None:
            return tokens, torch.einsum("bmk,bm,->bk", assign, scaled_sim, per_width), dest
        w = sizes if sizes.dtype == x.dtype else sizes.to(x.dtype)
        merged_sizes = torch.einsum("bmk,bm,bm,->bk", assign, w, scaled_sim, per_width)
        return tokens, merged_sizes if merged_sizes.dtype == sizes.dtype else merged_sizes.to(sizes.dtype), dest
    sizes = x.new_ones(B, M) if sizes is None else sizes
    with torch.no_grad():
        metric = F.normalize(x[:, num_prefix:], dim=-1)  # (B, m, C)
        sim = metric[:, k:] @ metric[:, :k].transpose(1, 2)  # (B, m − k, k) cosine
        node_max, to = sim.max(dim=-1)  # (B, m − k)
    patches = x[:, num_prefix:]
    out = patches[:, :k].clone()  # (B, k, C)
    add_rows_(out, to, patches[:, k:])
    count = torch.ones_like(sizes[:, :K]).scatter_add(1, to + num_prefix, torch.ones_like(sizes[:, K:]))  # (B, K)
    tokens = torch.cat([x[:, :num_prefix], out], dim=1) / count[..., None].to(x.dtype)
    merged_sizes = sizes[:, :K].scatter_add(1, to + num_prefix, sizes[:, K:] * node_max.to(sizes.dtype))
    stay = cached(("arange_rows", B, K, x.device), lambda: torch.arange(K, device=x.device).repeat(B, 1))
    return tokens, merged_sizes, torch.cat([stay, to + num_prefix], dim=1)


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
    def for_model(cls, model: nn.Module, layers: tuple[int, ...], **options: Any) -> dict[int, Reducer | None]:
        """:meth:`for_layers`, and a count that would leave no patch token refused now rather than at every batch."""
        reducers = cls.for_layers(layers, **options)
        prefix = int(getattr(model, "num_prefix", 1))
        for reducer in reducers.values():
            assert isinstance(reducer, DiffRate)
            for name in ("prune_kept", "merge_kept"):
                if getattr(reducer, name) <= prefix:
                    raise ValueError(
                        f"{name}={getattr(reducer, name)} keeps no patch token: the model has {prefix} prefix "
                        f"token(s), which the count includes; expected more than {prefix}"
                    )
        return reducers

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
        if merged < 1:
            raise ValueError(f"merge_kept={self.merge_kept} leaves no patch token to merge into ({p} prefix tokens)")
        # one top-k over all tokens, the prefix raised: the prefix, then the `pruned` most attended, most first
        index = ranking_scores(attention, p).topk(p + pruned, dim=1).indices  # (B, p + pruned)
        state = keep_rows(state, index)
        if merged == pruned:
            return state
        tokens, sizes, dest = merge_into_attentive(state.tokens, state.sizes, p, merged)
        return state.replace(
            tokens=tokens,
            positions=None if state.positions is None else state.positions[:, :merged],
            fused=None if state.fused is None else state.fused[:, :merged],
            sizes=sizes,
            size_bias=True,
            patch_to_token=record_reduction(state, dest[:, p:] - p) if state.record else state.patch_to_token,
        )

    def extra_repr(self) -> str:
        return f"prune_kept={self.prune_kept}, merge_kept={self.merge_kept}"
