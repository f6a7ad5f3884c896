"""ToMe (Bolya et al., ICLR 2023): merge the r most similar token pairs in every block, no training needed.

Bipartite soft matching, as the authors' ``merge.py`` does it, on the N tokens entering the merge (prefix included):

1. metric = the block's keys averaged over heads (B, N, hd), L2-normalised (cosine similarity);
2. split by index parity: set a = tokens 0, 2, 4, …; set b = tokens 1, 3, 5, …;
3. every a token proposes its most similar b token; prefix tokens are protected (their similarities are −∞: an a-side
   prefix token never merges away, a b-side one never receives a merge);
4. the r a tokens with the best proposals merge into their b partner: x = Σ x·size / Σ size, size = Σ size.

r is capped at ⌊(N − num_prefix) / 2⌋, so tokens never run out. The merged sequence is laid out as
[prefix tokens, unmerged a tokens (in token order), b tokens (in token order)], which for one [CLS] token (or [CLS]
+ DeiT's distillation token) is exactly the authors' order. Sizes feed proportional attention: the Block adds
log(size) to the logits through ``TokenState.attention_bias``. The matching itself is discrete (no gradient); the
merge is differentiable in the tokens.

The algorithm is a set of pure functions of tensors (:func:`bipartite_soft_matching`, :func:`merge_wavg`,
:func:`merge_plan`, :func:`token_destinations`); :class:`ToMe` is the thin adapter that a Block calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.attention import AttentionResult
from vitrim.reduce.base import Reducer, StrengthOption
from vitrim.reduce.index_cache import cached_arange
from vitrim.reduce.registry import register
from vitrim.reduce.schedule import Schedule
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import add_rows_, record_reduction, take_rows


@dataclass(frozen=True)
class Matching:
    """Which tokens merge where, in set-local indices (a-index i is token 2i, b-index j is token 2j + 1).

    unm_idx: (B, Na − r) a tokens that stay, ascending; src_idx: (B, r) a tokens that merge away;
    dst_idx: (B, r) the b token each of them merges into. Na = ⌈N/2⌉.
    """

    unm_idx: Tensor
    src_idx: Tensor
    dst_idx: Tensor
    num_prefix: int

    @property
    def r(self) -> int:
        return self.src_idx.shape[1]


def max_merges(num_tokens: int, num_prefix: int) -> int:
    """The most tokens one merge can remove: half of the mergeable (non-prefix) tokens, rounded down."""
    return max(0, (num_tokens - num_prefix) // 2)


@torch.no_grad()
def bipartite_soft_matching(metric: Tensor, r: int, num_prefix: int) -> Matching:
    """Match the r most similar (a, b) pairs of ``metric`` (B, N, C); r is capped by :func:`max_merges`."""
    N = metric.shape[1]
    r = min(r, max_merges(N, num_prefix))
    metric = metric / torch.linalg.vector_norm(metric, dim=-1, keepdim=True)
    a, b = metric[:, ::2], metric[:, 1::2]  # (B, Na, C), (B, Nb, C)
    scores = a @ b.transpose(1, 2)  # (B, Na, Nb) cosine similarities
    pa, pb = (num_prefix + 1) // 2, num_prefix // 2  # prefix tokens in a (indices 0, 2, …) and in b (1, 3, …)
    if pa:
        scores[:, :pa].fill_(float("-inf"))
    if pb:
        scores[:, :, :pb].fill_(float("-inf"))
    node_max, node_idx = scores.max(dim=-1)  # (B, Na): each a token's best b partner
    # Stable: equal similarities (identical patches) rank in token order on every device and in ONNX (TopK's rule).
    edge_idx = node_max.argsort(dim=-1, descending=True, stable=True)  # (B, Na) most similar first
    unm_idx = edge_idx[:, r:].sort(dim=-1).values  # (B, Na − r): prefix a tokens come first
    src_idx = edge_idx[:, :r]  # (B, r)
    dst_idx = node_idx.gather(1, src_idx)  # (B, r)
    return Matching(unm_idx, src_idx, dst_idx, num_prefix)


@dataclass(frozen=True)
class MergePlan:
    """Token-index form of a :class:`Matching` on N tokens, computed once and shared by the merge and the bookkeeping.

    keep: (B, N − r) the token each merged-sequence token continues (the module layout); src: (B, r) the tokens that
    merge away; dst: (B, r) the token each merges into; dst_out: (B, r) where that token stands in the output.
    """

    keep: Tensor
    src: Tensor
    dst: Tensor
    dst_out: Tensor


def merge_plan(m: Matching, num_tokens: int) -> MergePlan:
    """The token indices of matching ``m`` on ``num_tokens`` tokens (constant parts built once per shape)."""
    p, r = m.num_prefix, m.r
    pa, pb = (p + 1) // 2, p // 2
    B, device = m.unm_idx.shape[0], m.unm_idx.device
    b_tokens = cached_arange(2 * pb + 1, num_tokens, 2, device=device).expand(B, -1)  # non-prefix b tokens
    if pb == 0:  # no prefix token among the b tokens: the a tokens (prefix first, as unm_idx is sorted) lead
        keep = torch.cat([2 * m.unm_idx, b_tokens], dim=1)  # (B, N − r)
    else:
        prefix = cached_arange(0, p, device=device).expand(B, p)
        keep = torch.cat([prefix, 2 * m.unm_idx[:, pa:], b_tokens], dim=1)  # (B, N − r)
    first_b = p + (num_tokens + 1) // 2 - r - pa  # where the first non-prefix b token stands in the output
    return MergePlan(keep, 2 * m.src_idx, 2 * m.dst_idx + 1, m.dst_idx + (first_b - pb))


def merge_wavg(x: Tensor, sizes: Tensor, m: Matching | MergePlan) -> tuple[Tensor, Tensor]:
    """Size-weighted merge: x (B, N, C), sizes (B, N) -> x (B, N − r, C) = Σ x·size / Σ size, sizes (B, N − r).

    Written as b_j + Σ_i s_i (x_i − b_j) / S_j (S_j the merged size) so that only the r merged rows are touched
    after one gather of the N − r kept rows: the hot path reads x about once, instead of scaling and dividing all
    of it. Tokens that take part in no merge are copied exactly.
    """
    plan = m if isinstance(m, MergePlan) else merge_plan(m, x.shape[1])
    out = take_rows(x, plan.keep)  # (B, N − r, C)
    out_sizes = sizes.gather(1, plan.keep)  # (B, N − r)
    r = plan.src.shape[1]
    if r == 0:
        return out, out_sizes
    src_sizes = sizes.gather(1, plan.src)  # (B, r)
    out_sizes = out_sizes.scatter_add(1, plan.dst_out, src_sizes)
    weight = src_sizes / out_sizes.gather(1, plan.dst_out)  # (B, r) s_i / S_j
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    x_src, x_dst = take_rows(x, torch.cat([plan.src, plan.dst], dim=1)).split(r, dim=1)  # (B, r, C) each
    add_rows_(out, plan.dst_out, (x_src - x_dst) * weight.unsqueeze(-1))
    return out, out_sizes


def token_destinations(m: Matching | MergePlan, num_tokens: int) -> Tensor:
    """(B, N) long: the index in the merged sequence of every token that entered the merge (see module layout)."""
    plan = m if isinstance(m, MergePlan) else merge_plan(m, num_tokens)
    B, kept = plan.keep.shape
    slots = cached_arange(0, kept, device=plan.keep.device).expand(B, kept)
    dest = torch.empty(B, num_tokens, dtype=torch.long, device=plan.keep.device)
    return dest.scatter_(1, plan.keep, slots).scatter_(1, plan.src, plan.dst_out)  # kept tokens, then merged ones


def parse_r(num_layers: int, r: object) -> list[int]:
    """ToMe's ``r`` forms, read exactly as ``tome.utils.parse_r`` reads them, one value per block:

    * an int: that many merges in every block;
    * a tuple ``(r, inflection)``: min = int(r · (1 − inflection)), max = 2r − min, block i merges
      int(min + (max − min) / (L − 1) · i) (inflection −1 is the paper's decreasing schedule; 0 is constant);
    * a list: one int per block; a shorter list is padded with 0.
    """
    if isinstance(r, list):
        if len(r) > num_layers:
            raise ValueError(f"r as a list needs at most one value per block ({num_layers}), got {len(r)} values: {r}")
        values = r + [0] * (num_layers - len(r))
    else:
        inflection = 0.0
        if isinstance(r, tuple):
            if len(r) != 2:
                raise ValueError(f"r as a tuple must be (r, inflection), got {r!r}; give a list for one r per block")
            r, inflection = r
            if isinstance(inflection, bool) or not isinstance(inflection, (int, float)) or not -1 <= inflection <= 1:
                raise ValueError(f"the inflection of r=(r, inflection) must be a number in [-1, 1], got {inflection!r}")
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"r must be an int >= 0 (tokens merged per block), (r, inflection) or a list, got {r!r}")
        low = int(r * (1.0 - inflection))
        high = 2 * r - low
        step = (high - low) / max(1, num_layers - 1)  # (ToMe divides by L - 1; one block has no slope)
        values = [int(low + step * i) for i in range(num_layers)]
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"r must be an int >= 0 (tokens merged per block) or a list of them, got {r!r}")
    return values


@register("tome")
class ToMe(Reducer):
    """Merge ``r`` tokens in this block by bipartite soft matching on the keys (see module doc).

    Options (ToMe's names): ``r`` in any form :func:`parse_r` reads, over the blocks of ``layers`` (default: every
    block); ``prop_attn`` (default True, as ToMe's timm patch): add log(size) to the attention logits after a merge
    (ToMe recommends False for MAE checkpoints and for training); ``trace_source`` (default True): keep the
    ``patch_to_token`` record that pictures need; False saves its cost at batch 1.
    """

    example_options: ClassVar[dict[str, Any]] = {"r": 3}
    identity_options: ClassVar[dict[str, Any]] = {"r": 0}
    strength_option: ClassVar[StrengthOption | None] = StrengthOption("r", weakest=0, strongest=None)

    def __init__(self, r: int, prop_attn: bool = True, trace_source: bool = True) -> None:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"r must be an int >= 0 (tokens merged per block), got {r!r}")
        for name, value in (("prop_attn", prop_attn), ("trace_source", trace_source)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self.r = r
        self.prop_attn = prop_attn
        self.trace_source = trace_source

    @classmethod
    def for_layers(  # type: ignore[override]  # a reducer takes its own options; apply checks their names
        cls,
        layers: tuple[int, ...],
        *,
        r: int | tuple[int, float] | list[int],
        prop_attn: bool = True,
        trace_source: bool = True,
    ) -> dict[int, Reducer | None]:
        schedule = parse_r(len(layers), r)
        return {
            layer: cls(value, prop_attn, trace_source) if value > 0 else None for layer, value in zip(layers, schedule)
        }

    @classmethod
    def options_for_schedule(cls, schedule: Schedule) -> tuple[tuple[int, ...], dict[str, Any]]:
        """Every block, merging as many tokens as the schedule removes there."""
        before = (schedule.num_tokens, *schedule.tokens_after()[:-1])
        return tuple(range(schedule.depth)), {"r": [b - a for b, a in zip(before, schedule.tokens_after())]}

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        x = state.tokens  # (B, N, C)
        B, N, _ = x.shape
        p = state.num_prefix
        if min(self.r, max_merges(N, p)) <= 0:
            return state
        if state.keep_policy is not None:
            raise ValueError("ToMe cannot follow a training-time keep_policy (DynamicViT training); got one")
        state = state.replace(size_bias=self.prop_attn, trace=state.trace and self.trace_source)
        # The mean of the keys over heads; summed, as only its direction counts (cosine), and torch's sum over a
        # strided dim is many times faster than its mean on CPU.
        m = bipartite_soft_matching(attention.k.sum(dim=1), self.r, p)  # keys (B, H, N, hd) -> metric (B, N, hd)
        plan = merge_plan(m, N)
        sizes = state.sizes if state.sizes is not None else x.new_ones(B, N)
        tokens, sizes = merge_wavg(x, sizes, plan)
        # A merged token keeps its b token's position (the token it continues), and its fused flag (EViT).
        continued = plan.keep[:, p:] - p  # (B, N − r − p)
        patch_to_token = record_reduction(state, token_destinations(plan, N)[:, p:] - p) if state.trace else None
        return state.replace(
            tokens=tokens,
            positions=state.positions.gather(1, continued),
            fused=None if state.fused is None else state.fused.gather(1, continued),
            sizes=sizes,
            patch_to_token=state.patch_to_token if patch_to_token is None else patch_to_token,
        )

    def extra_repr(self) -> str:
        flags = "" if self.prop_attn else ", prop_attn=False"
        return f"r={self.r}{flags}" + ("" if self.trace_source else ", trace_source=False")
