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
import torch.nn.functional as F
from torch import Tensor

from vitrim.attention import AttentionResult
from vitrim.reduce.base import Reducer, StrengthOption
from vitrim.reduce.index_cache import cached
from vitrim.reduce.registry import register
from vitrim.reduce.schedule import Schedule
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import add_rows_, merge_rows, record_reduction, take_rows


@dataclass(frozen=True)
class Matching:
    """Where every token goes in one merge of N tokens into N − r (the module's layout).

    dest: (B, N) long, the output row of every token (a merged a token: its b partner's row); order: (B, N) long,
    the tokens in output order: ``order[:, :N − r]`` the token each output row continues, ``order[:, N − r:]`` the r
    tokens merged away.
    """

    dest: Tensor
    order: Tensor
    num_prefix: int
    r: int

    @property
    def num_out(self) -> int:
        """N − r, the tokens after the merge."""
        return self.order.shape[1] - self.r


def max_merges(num_tokens: int, num_prefix: int) -> int:
    """The most tokens one merge can remove: half of the mergeable (non-prefix) tokens, rounded down."""
    return max(0, (num_tokens - num_prefix) // 2)


def _pair_bias(num_tokens: int, num_prefix: int, width: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(N, N) added to the similarities of N tokens (rows propose, columns receive): 0 where a non-prefix a token
    (even index) may propose a non-prefix b token (odd index); −∞ at every other pair, except on the diagonal of the
    rows that propose nothing (b and prefix tokens), where −3·width puts their maximum on themselves (their
    similarity to themselves is +width, every real proposal is at least −width)."""
    i = torch.arange(num_tokens, device=device)
    proposes = (i % 2 == 0) & (i >= num_prefix)  # non-prefix a tokens
    receives = (i % 2 == 1) & (i >= num_prefix)  # non-prefix b tokens
    bias = torch.full((num_tokens, num_tokens), float("-inf"), dtype=dtype, device=device)
    bias = bias.masked_fill(proposes[:, None] & receives[None, :], 0.0)
    return bias.masked_fill(torch.diag(~proposes), -3.0 * width)


def _layout_key(batch: int, num_tokens: int, num_prefix: int, device: torch.device) -> Tensor:
    """(B, N) long, increasing along the module's layout: prefix tokens, then non-prefix a tokens, then non-prefix b
    tokens, each in token order (values below 3N; a merged token is given 3N)."""
    i = torch.arange(num_tokens, device=device)
    key = torch.where(i < num_prefix, i, torch.where(i % 2 == 0, num_tokens + i, 2 * num_tokens + i))
    return key.repeat(batch, 1)


@torch.no_grad()
def bipartite_soft_matching(metric: Tensor, r: int, num_prefix: int) -> Matching:
    """Match the r most similar (a, b) pairs of ``metric`` (B, N, C); r is capped by :func:`max_merges`.

    Written in few, whole-tensor calls (a batch-1 forward pays per call): the similarities of all N tokens at once,
    with the pairs that may not merge masked (:func:`_pair_bias`); the merged a tokens pushed behind the layout; the
    output rows read off one sort and its inverse. A token's row is the smaller of its own rank and its partner's:
    a merged a token ranks behind everything, an unmerged a token ranks before every b token, and a token that
    proposes nothing is its own partner.
    """
    B, N, C = metric.shape
    r = min(r, max_merges(N, num_prefix))
    device = metric.device
    # m / ‖m‖ · √C: cosine similarity times C, which ranks the same (eps: tiny, so only a zero metric is touched)
    unit = F.rms_norm(metric, (C,), eps=torch.finfo(metric.dtype).tiny)  # (B, N, C)
    bias = cached(
        ("tome_pairs", N, num_prefix, C, metric.dtype, device),
        lambda: _pair_bias(N, num_prefix, C, metric.dtype, device),
    )
    scores = torch.baddbmm(bias, unit, unit.mT)  # (B, N, N)
    best, partner = scores.max(dim=-1)  # (B, N): each a token's most similar b token; others: themselves
    # topk, not a stable sort: only the r best are needed (ties between distinct tokens' similarities do not occur;
    # identical tokens give the same merged values whichever merges)
    merged = best.topk(r, dim=-1).indices  # (B, r)
    key = cached(("tome_layout", B, N, num_prefix, device), lambda: _layout_key(B, N, num_prefix, device))
    order = key.scatter(1, merged, 3 * N).argsort(dim=-1)  # (B, N): kept tokens in layout order, then the merged
    rank = order.argsort(dim=-1)  # (B, N): where each token stands in that order
    dest = torch.minimum(rank, rank.gather(1, partner))  # (B, N)
    return Matching(dest, order, num_prefix, r)


def merge_wavg(x: Tensor, sizes: Tensor | None, m: Matching) -> tuple[Tensor, Tensor]:
    """Size-weighted merge: x (B, N, C), sizes (B, N) (None: ones) -> x (B, N − r, C) = Σ x·size / Σ size, and the
    summed sizes (B, N − r).

    At batch 1 one product with the one-hot assignment (:func:`vitrim.reduce.tokens.merge_rows`). Above it, written
    as b_j + Σ_i s_i (x_i − b_j) / S_j (S_j the merged size), so that only the r merged rows are touched after one
    gather of the N − r kept rows: the hot path reads x about once, and tokens that take part in no merge are copied
    exactly.
    """
    N, kept = x.shape[1], m.num_out
    if m.r == 0 or (x.shape[0] == 1 and not torch.compiler.is_compiling()):
        return merge_rows(x, m.dest, kept, sizes)
    sizes = x.new_ones(x.shape[0], N) if sizes is None else sizes
    keep, src = m.order[:, :kept], m.order[:, kept:]  # (B, N − r), (B, r)
    dst = m.dest.gather(1, src)  # (B, r) the output row each merged token joins
    out = take_rows(x, keep)  # (B, N − r, C)
    out_sizes = sizes.gather(1, keep).scatter_add(1, dst, sizes.gather(1, src))  # (B, N − r)
    weight = sizes.gather(1, src) / out_sizes.gather(1, dst)  # (B, r) s_i / S_j
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    x_src, x_dst = take_rows(x, torch.cat([src, keep.gather(1, dst)], dim=1)).split(src.shape[1], dim=1)
    add_rows_(out, dst, (x_src - x_dst) * weight.unsqueeze(-1))
    return out, out_sizes


def token_destinations(m: Matching, num_tokens: int) -> Tensor:
    """(B, N) long: the index in the merged sequence of every token that entered the merge (see module layout)."""
    if m.dest.shape[1] != num_tokens:
        raise ValueError(f"the matching is of {m.dest.shape[1]} tokens, not {num_tokens}")
    return m.dest


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
    merges_at_most_half: ClassVar[bool] = True  # bipartite matching: max_merges

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
        N, p = x.shape[1], state.num_prefix
        if min(self.r, max_merges(N, p)) <= 0:
            return state
        if state.keep_policy is not None:
            raise ValueError("ToMe cannot follow a training-time keep_policy (DynamicViT training); got one")
        # The mean of the keys over heads; summed, as only its direction counts (cosine), and torch's sum over a
        # strided dim is many times faster than its mean on CPU.
        m = bipartite_soft_matching(attention.k.sum(dim=1), self.r, p)  # keys (B, H, N, hd) -> metric (B, N, hd)
        tokens, sizes = merge_wavg(x, state.sizes, m)
        merged = state.replace(
            tokens=tokens, sizes=sizes, size_bias=self.prop_attn, trace=state.trace and self.trace_source
        )
        if state.positions is None and not state.record:
            return merged
        # A merged token keeps its b token's position (the token it continues), and its fused flag (EViT).
        continued = m.order[:, p : m.num_out] - p  # (B, N − r − p)
        return merged.replace(
            positions=None if state.positions is None else state.positions.gather(1, continued),
            fused=None if state.fused is None else state.fused.gather(1, continued),
            patch_to_token=record_reduction(merged, m.dest[:, p:] - p),
        )

    def extra_repr(self) -> str:
        flags = "" if self.prop_attn else ", prop_attn=False"
        return f"r={self.r}{flags}" + ("" if self.trace_source else ", trace_source=False")
