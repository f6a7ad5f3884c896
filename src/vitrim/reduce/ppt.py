"""PPT (Wu et al., 2023, "Token Pruning and Pooling"): per block and per image, prune inattentive tokens or pool
(merge) duplicative ones, chosen by how spread the tokens' significance scores are. No training needed.

Conventions, read from the authors' code (xjwu1024/PPT, ``ppt_deit.py`` ``PPTAttention.score_assignment_step``,
``pp_block_adaptive``, ``apply_patch``; ``tome.py`` ``bipartite_soft_matching``, ``merge_wavg``; ``main.py`` and
``eval.sh`` for the defaults) and adopted here:

* Where: in the blocks of ``layers`` (the authors' ``pp_loc_list``; default a quarter, half and three quarters deep,
  3, 6, 9 of 12, as their DeiT-S command), after the attention residual, before the MLP.
* Score (ATS's significance): s_j = (Σ_heads A_{[CLS], j}) · ‖v_j‖ for each patch token j, ‖v_j‖ the norm of its
  values over all heads, normalised to Σ_j s_j = 1; A is the block's own softmax (with the log-size bias when
  proportional attention is on).
* Decision, per image: Var(s) (unbiased, ``torch.var``) < ``threshold`` (default 7e-5, the authors' DeiT-S
  evaluation) means the scores are flat, so the tokens are duplicative: pool; otherwise prune.
* Counts: r = min(``r``, ⌊n / 2⌋) tokens removed per reducing block (``--r_tokens``, 50 in the authors' DeiT-S
  command), n = the patch tokens entering it; both branches leave n − r patch tokens.
* Prune: keep the n − r highest-scoring patch tokens, in descending score order (``torch.sort``); their sizes stay.
* Pool: ToMe's bipartite soft matching on the keys averaged over heads (even/odd split, prefix protected, ToMe's
  layout; :func:`vitrim.reduce.tome.bipartite_soft_matching`), size-weighted merge.
* Batches: both branches' destinations are computed for the whole batch, each image takes its own with
  ``torch.where``, and one merge (:func:`vitrim.reduce.tokens.merge_rows`) makes the tokens: a pruned token weighs 0,
  a kept one is its own group (the authors split the batch into two sub-batches; the result per image is the same,
  and this form traces and exports).
* Proportional attention: on (``prop_attn=True``, the authors' default, ``--prop_attn`` is store_false).
* Protected: every prefix token. The authors protect [CLS] in both branches and the distillation token only in
  pooling (a deviation only on distilled models).
* Provenance: ``patch_to_token`` records each image's reduction; ``kept_indices`` is not appended (an image may have
  pooled, so "kept" is not defined batch-wide).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.attention import AttentionResult
from vitrim.reduce.base import Reducer, StrengthOption, quarter_layers
from vitrim.reduce.cls_ranking import cls_rows
from vitrim.reduce.index_cache import cached
from vitrim.reduce.registry import register
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import merge_rows, record_reduction
from vitrim.reduce.tome import bipartite_soft_matching


def significance_scores(attention: AttentionResult) -> Tensor:
    """(B, N): ATS's significance of every token, unnormalised: [CLS] attention summed over heads × ‖v‖ (the
    values' norm over all heads). Normalising the patch tokens' to sum 1 changes no order."""
    if attention.v is None:
        raise ValueError("PPT scores tokens by their values; the attention result carries no v")
    v_norm = torch.linalg.vector_norm(attention.v, dim=(1, 3))  # (B, N) over heads and channels
    return cls_rows(attention).sum(dim=(1, 2)) * v_norm


def ppt_patches_left(patches: int, rs: Sequence[int]) -> int:
    """The patch tokens left of ``patches`` after PPT blocks removing ``rs``, in block order: each removes
    min(r, ⌊n / 2⌋) of the n patch tokens entering it, and pruning and pooling both leave n − that many, so the count
    is fixed by r and n alone, whatever each image's choice (what a server writes as an image's placeholders before
    the tower runs: vitrim.vllm)."""
    left = patches
    for r in rs:
        left -= min(r, left // 2)
    return left


def _first(num_tokens: int, num_prefix: int, device: torch.device) -> Tensor:
    """(N,) bool: the prefix tokens."""
    return torch.arange(num_tokens, device=device) < num_prefix


@register("ppt")
class PPT(Reducer):
    """Adaptive pruning or pooling of ``r`` tokens per reducing block (see module doc)."""

    needs_cls_token = True
    example_options: ClassVar[dict[str, Any]] = {"r": 4, "layers": (1, 2)}
    identity_options: ClassVar[dict[str, Any]] = {"r": 0}
    strength_option: ClassVar[StrengthOption | None] = StrengthOption("r", weakest=0, strongest=None)

    def __init__(self, r: int, threshold: float = 7e-5, prop_attn: bool = True) -> None:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"r must be an int >= 0 (tokens removed per reducing block), got {r!r}")
        self.r = r
        self.threshold = float(threshold)
        self.prop_attn = bool(prop_attn)

    default_layers = staticmethod(quarter_layers)

    @classmethod
    def for_layers(  # type: ignore[override]  # a reducer takes its own options; apply checks their names
        cls, layers: tuple[int, ...], *, r: int | Sequence[int], threshold: float = 7e-5, prop_attn: bool = True
    ) -> dict[int, Reducer | None]:
        if isinstance(r, Sequence) and not isinstance(r, str):
            if len(r) != len(layers):
                raise ValueError(f"r must be one int or one per reducing block ({len(layers)}), got {list(r)}")
            schedule = list(r)
        else:
            schedule = [r] * len(layers)
        return {layer: cls(value, threshold, prop_attn) for layer, value in zip(layers, schedule)}

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        x, p = state.tokens, state.num_prefix  # (B, N, C)
        N = x.shape[1]
        r = min(self.r, (N - p) // 2)
        if r <= 0:
            return state
        if state.keep_policy is not None:
            raise ValueError("PPT cannot follow a training-time keep_policy (DynamicViT training); got one")
        K = N - r  # tokens after the block, either way
        significance = significance_scores(attention)  # (B, N)
        patches = significance[:, p:]  # (B, n)
        pool = (patches / patches.sum(dim=1, keepdim=True)).var(dim=1) < self.threshold  # (B,) flat: duplicative
        # Prune: every token's place in descending significance, the prefix first (stable: +inf ties keep order).
        prefix = cached(("prefix_mask", N, p, x.device), lambda: _first(N, p, x.device))
        prune_order = torch.where(prefix, float("inf"), significance).argsort(dim=1, descending=True, stable=True)
        prune_rank = prune_order.argsort(dim=1)  # (B, N)
        kept = prune_rank < K  # (B, N)
        # Pool: ToMe's matching on the keys (summed over heads: a cosine sees only their direction).
        m = bipartite_soft_matching(attention.k.sum(dim=1), r, p)
        # Each image takes its own branch; both are one merge (a pruned token weighs 0 and goes anywhere).
        per_image = pool[:, None]  # (B, 1)
        dest = torch.where(per_image, m.dest, prune_rank.clamp_max(K - 1))  # (B, N)
        counted = per_image | kept  # (B, N)
        weights = counted.to(x.dtype) if state.sizes is None else torch.where(counted, state.sizes, 0.0)
        tokens, sizes = merge_rows(x, dest, K, weights)
        merged = state.replace(tokens=tokens, sizes=sizes, size_bias=self.prop_attn)
        if state.positions is None and not state.record:
            return merged
        continued = torch.where(per_image, m.order, prune_order)[:, p:K] - p  # (B, K − p) the token each continues
        dropped = torch.where(per_image | kept, dest, -1)[:, p:]  # (B, n)
        return merged.replace(
            positions=None if state.positions is None else state.positions.gather(1, continued),
            fused=None if state.fused is None else state.fused.gather(1, continued),
            patch_to_token=record_reduction(merged, torch.where(dropped < 0, dropped, dropped - p)),
        )

    def extra_repr(self) -> str:
        return f"r={self.r}, threshold={self.threshold:g}"
