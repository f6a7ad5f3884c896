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
  layout; :func:`pooling_matching`, masked rather than sliced so it exports), size-weighted merge written with
  gathers and a dense assignment product (:mod:`vitrim.reduce.assign`).
* Batches: both branches are computed for the whole batch and each image takes its own with ``torch.where`` (the
  authors split the batch into two sub-batches; the result per image is the same, and this form traces and exports).
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
from vitrim.reduce.assign import merge_tokens
from vitrim.reduce.base import Reducer, StrengthOption, quarter_layers
from vitrim.reduce.cls_ranking import cls_attention
from vitrim.reduce.registry import register
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import keep_tokens


def significance_scores(attention: AttentionResult, num_prefix: int) -> Tensor:
    """(B, n): ATS's significance of the patch tokens, [CLS] attention summed over heads × ‖v‖, summing to 1."""
    if attention.v is None:
        raise ValueError("PPT scores tokens by their values; the attention result carries no v")
    B, H, N, hd = attention.v.shape
    v_norm = attention.v.transpose(1, 2).reshape(B, N, H * hd).norm(dim=-1)  # (B, N)
    scores = (cls_attention(attention).sum(dim=1) * v_norm)[:, num_prefix:]  # (B, n)
    return scores / scores.sum(dim=1, keepdim=True)


@torch.no_grad()
def pooling_matching(metric: Tensor, r: int, num_prefix: int) -> tuple[Tensor, Tensor, Tensor]:
    """ToMe's bipartite soft matching (a = even tokens, b = odd, prefix protected) as keep, src, src_dest in patch-token
    indices with ToMe's layout [unmerged a, b] (see :mod:`vitrim.reduce.assign`). Prefix rows and columns are masked
    rather than sliced, so the traced graph has no empty tensors (ONNX)."""
    B, N, _ = metric.shape
    p = num_prefix
    pa, pb = (p + 1) // 2, p // 2
    metric = metric / metric.norm(dim=-1, keepdim=True)
    scores = metric[:, ::2] @ metric[:, 1::2].transpose(1, 2)  # (B, Na, Nb) cosine similarities
    Na, Nb = scores.shape[1], scores.shape[2]
    a_prefix = torch.arange(Na, device=metric.device) * 2 < p  # (Na,)
    b_prefix = torch.arange(Nb, device=metric.device) * 2 + 1 < p  # (Nb,)
    scores = scores.masked_fill(a_prefix[:, None] | b_prefix[None, :], float("-inf"))
    node_max, node_idx = scores.max(dim=-1)  # (B, Na)
    edge_idx = node_max.argsort(dim=-1, descending=True)  # (B, Na)
    unm = edge_idx[:, r:].sort(dim=-1).values[:, pa:]  # (B, Na − r − pa) prefix a tokens sort first
    src = edge_idx[:, :r]  # (B, r)
    b_tokens = torch.arange(2 * pb + 1, N, 2, device=metric.device).expand(B, -1)  # (B, Nb − pb)
    keep = torch.cat([2 * unm, b_tokens], dim=1) - p
    src_dest = unm.shape[1] + node_idx.gather(1, src) - pb
    return keep, 2 * src - p, src_dest


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

    @classmethod
    def default_layers(cls, depth: int) -> tuple[int, ...]:
        return quarter_layers(depth)

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
        n, p = state.num_patch_tokens, state.num_prefix
        r = min(self.r, n // 2)
        if r <= 0:
            return state
        if state.keep_policy is not None:
            raise ValueError("PPT cannot follow a training-time keep_policy (DynamicViT training); got one")
        state = state.replace(size_bias=self.prop_attn)
        scores = significance_scores(attention, p)  # (B, n)
        pool = scores.var(dim=1) < self.threshold  # (B,) flat scores: duplicative tokens
        order = torch.sort(scores, dim=1, descending=True).indices  # (B, n)
        pruned = keep_tokens(state, order[:, : n - r])
        pooled = merge_tokens(state, *pooling_matching(attention.k.mean(dim=1), r, p))
        ones = state.tokens.new_ones(state.tokens.shape[0], n - r + p)
        pruned_sizes = pruned.sizes if pruned.sizes is not None else ones
        assert pooled.sizes is not None
        row, col = pool[:, None], pool[:, None, None]
        return pooled.replace(
            tokens=torch.where(col, pooled.tokens, pruned.tokens),
            positions=None
            if pooled.positions is None or pruned.positions is None
            else torch.where(row, pooled.positions, pruned.positions),
            sizes=torch.where(row, pooled.sizes, pruned_sizes),
            patch_to_token=(
                *state.patch_to_token,
                torch.where(row, pooled.patch_to_token[-1], pruned.patch_to_token[-1]),
            )
            if pooled.patch_to_token and pruned.patch_to_token
            else state.patch_to_token,
        )

    def extra_repr(self) -> str:
        return f"r={self.r}, threshold={self.threshold:g}"
