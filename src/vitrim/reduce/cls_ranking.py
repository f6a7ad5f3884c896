"""Ranking patch tokens by the [CLS] row of a block's attention: what EViT and top-k share.

The [CLS] row is never read from an N × N matrix that nobody asked for: when the block ran the fused kernel, it is
recomputed from the block's own q and k with the same attention function, scale, float bias (ToMe's log-size) and
keep-policy: one query against N keys, O(N) instead of O(N²). When the caller asked for the weights anyway
(``need_weights=True``), their first row is reused.

Counts (the authors' code, ``evit.py``: ``left_tokens = math.ceil(keep_rate * (N - 1))``): k = ⌈keep_rate · n⌉ of
the n non-prefix tokens that enter the block, an earlier stage's fused token included, computed in Python floats
exactly as there (so 0.07 · 100 = 7.000000000000001 keeps 8); keep_rate 1, or k = n, leaves the block dense.
On DeiT-S at 0.7 and blocks (3, 6, 9) that is 140/100/72 tokens after the stages with EViT's fused token and
139/98/69 with top-k ([CLS] included). Prefix tokens are always kept. Kept tokens stand in descending order of
attention, as EViT's ``torch.topk`` leaves them (one ``topk`` over all tokens, the prefix raised above every score).
Blocks: by default a quarter, half and three quarters deep (3, 6, 9 of 12), as EViT does for DeiT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrim.attention import AttentionResult, scaled_dot_product_attention
from vitrim.reduce.base import Reducer, StrengthOption, quarter_layers
from vitrim.reduce.index_cache import cached
from vitrim.reduce.schedule import Schedule
from vitrim.reduce.state import TokenState


def cls_attention(attention: AttentionResult) -> Tensor:
    """(B, H, N): softmax attention of query 0 ([CLS]) over all N keys, per head, as the block computed it.

    Semantics are :func:`vitrim.scaled_dot_product_attention`'s: logits q·kᵀ·scale + ``attention.mask``, keys gated
    by ``attention.keep_policy`` (the [CLS] key's own policy entry is 1 by the TokenState convention, so G_00 = 1
    holds as in the full matrix). With attention dropout in training, the reused weights are the dropped-out ones.
    Half-precision inputs give float32 weights (the softmax accumulates in float32, as the math backend does).
    """
    return cls_rows(attention)[:, :, 0]


def cls_rows(attention: AttentionResult) -> Tensor:
    """(B, H, 1, N): :func:`cls_attention` with the query dim kept (one call fewer for callers that reduce it)."""
    if attention.weights is not None:
        return attention.weights[:, :, :1]
    q, k, bias = attention.q[:, :, :1], attention.k, attention.mask  # q (B, H, 1, hd), k (B, H, N, hd)
    if attention.keep_policy is None and (bias is None or bias.is_floating_point()):
        # The common case in few calls. Full precision: attention over an identity value matrix, whose output is the
        # weights themselves (one fused call, the bias applied by the kernel; each output is one weight times 1,
        # exactly). Half precision: logits by einsum and the softmax accumulated in float32, as the math backend
        # does, since the kernel would round the weights (and the ranking) to half precision.
        N, dtype, device = k.shape[-2], q.dtype, q.device
        if dtype not in (torch.float16, torch.bfloat16):
            eye = cached(("eye4", N, dtype, device), lambda: torch.eye(N, dtype=dtype, device=device)[None, None])
            return F.scaled_dot_product_attention(q, k, eye, attn_mask=bias, scale=attention.scale)
        scale = cached(("scale", attention.scale, dtype, device), lambda: k.new_tensor(attention.scale))
        logits = torch.einsum("bhqc,bhnc,->bhqn", q, k, scale)  # (B, H, 1, N)
        return (logits if bias is None else logits + bias).softmax(dim=-1, dtype=torch.float32)
    # v = k: the output is not used, and k already has the right shape; the cost is one (1 × N) product per head.
    _, weights = scaled_dot_product_attention(
        q, k, k, bias, scale=attention.scale, keep_policy=attention.keep_policy, need_weights=True
    )
    assert weights is not None
    return weights  # (B, H, 1, N)


def ranking_scores(attention: AttentionResult, num_prefix: int) -> Tensor:
    """(B, N): EViT's score of every token (the [CLS] row averaged over heads), each prefix token's raised above
    every patch token's, in order, so that one top-k over all N tokens lists the prefix first, as it stands, then
    the patch tokens by descending score. The patch tokens' entries are the scores themselves (0 is added)."""
    if num_prefix < 1:
        raise ValueError("ranking tokens by [CLS] attention needs a [CLS] token (num_prefix >= 1), got num_prefix=0")
    scores = cls_rows(attention).mean(dim=(1, 2))  # (B, N) in [0, 1]
    N, device, dtype = scores.shape[1], scores.device, scores.dtype
    raise_prefix = cached(
        ("prefix_first", N, num_prefix, dtype, device),
        lambda: (
            (torch.arange(N, device=device) < num_prefix).to(dtype) * (2 + num_prefix - torch.arange(N, device=device))
        ),
    )  # (N,): 2 + p − i for prefix token i (above any attention weight, decreasing), 0 for patch tokens
    return scores + raise_prefix


def check_keep_rate(keep_rate: object) -> float:
    """Validate a keep rate: a number in (0, 1]."""
    if isinstance(keep_rate, bool) or not isinstance(keep_rate, (int, float)) or not 0.0 < keep_rate <= 1.0:
        raise ValueError(f"keep_rate must be a number in (0, 1] (fraction of patch tokens kept), got {keep_rate!r}")
    return float(keep_rate)


def check_keep_count(keep_count: object) -> int | None:
    """Validate a count of kept patch tokens: an int >= 1, or None."""
    if keep_count is not None and (isinstance(keep_count, bool) or not isinstance(keep_count, int) or keep_count < 1):
        raise ValueError(f"keep_count must be an int >= 1 (patch tokens kept) or None, got {keep_count!r}")
    return keep_count


def per_layer(name: str, value: object, layers: tuple[int, ...]) -> list[Any]:
    """One value for each block of ``layers``: a sequence of that length as it is, anything else repeated."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != len(layers):
            raise ValueError(
                f"{name} must be one value or one per reducing block ({len(layers)}: layers {layers}), "
                f"got {len(value)} values: {list(value)}"
            )
        return list(value)
    return [value] * len(layers)


def num_keep(num_tokens: int, keep_rate: float) -> int:
    """k = ⌈keep_rate · n⌉ of n non-prefix tokens, in floats as EViT's code computes it (module doc); n if rate 1."""
    if keep_rate >= 1.0:
        return num_tokens
    return min(num_tokens, math.ceil(keep_rate * num_tokens))


class KeepCountReducer(Reducer):
    """A reducer that keeps k of the n patch tokens entering a block, k from ``keep_rate`` or ``keep_count``; what
    it keeps is the subclass's. Shared by the [CLS] rankings below, the random baseline and Zero-TPrune.

    Option ``keep_rate`` in (0, 1]: one number, or (through ``apply``) one per reducing block; or ``keep_count``: the
    patch tokens kept, exactly (capped at those entering; one int, or one per reducing block), which overrides it.
    A subclass's other options are its constructor's keyword parameters after these two, the same for every block.
    """

    appends_tokens: ClassVar[int] = 0  # tokens a reduction adds after the kept ones (EViT's fused token: 1)
    example_options: ClassVar[dict[str, Any]] = {"keep_rate": 0.5, "layers": (1, 3)}
    identity_options: ClassVar[dict[str, Any]] = {"keep_rate": 1.0, "layers": (0, 1, 2, 3)}
    strength_option: ClassVar[StrengthOption | None] = StrengthOption("keep_rate", 1.0, 0.001, step=0.001)

    def __init__(self, keep_rate: float = 0.7, keep_count: int | None = None) -> None:
        self.keep_rate = check_keep_rate(keep_rate)
        self.keep_count = check_keep_count(keep_count)

    default_layers = staticmethod(quarter_layers)

    @classmethod
    def for_layers(  # its own options (and a subclass's, passed on); apply checks their names
        cls,
        layers: tuple[int, ...],
        *,
        keep_rate: float | Sequence[float] = 0.7,
        keep_count: int | Sequence[int] | None = None,
        **options: Any,
    ) -> dict[int, Reducer | None]:
        rates = per_layer("keep_rate", keep_rate, layers)
        counts = per_layer("keep_count", keep_count, layers)
        return {layer: cls(rate, count, **options) for layer, rate, count in zip(layers, rates, counts)}

    @classmethod
    def options_for_schedule(cls, schedule: Schedule) -> tuple[tuple[int, ...], dict[str, Any]]:
        """The reducing blocks of the schedule, each keeping the patch tokens that leave its count."""
        steps = schedule.reductions()
        counts = [after - schedule.num_prefix - cls.appends_tokens for _, _, after in steps]
        return tuple(i for i, _, _ in steps), {"keep_count": counts}

    def num_kept(self, n: int) -> int:
        """Patch tokens kept of the n entering: ``keep_count`` (capped at n), else ⌈keep_rate · n⌉."""
        return num_keep(n, self.keep_rate) if self.keep_count is None else min(n, self.keep_count)

    def extra_repr(self) -> str:
        return f"keep_rate={self.keep_rate}" if self.keep_count is None else f"keep_count={self.keep_count}"


class ClsRankingReducer(KeepCountReducer):
    """A reducer that keeps the k patch tokens [CLS] attends to most (k: :class:`KeepCountReducer`); subclasses
    decide what happens to the rest."""

    needs_cls_token = True
    constant_ranking_scores = True  # [CLS]'s attention ranks (discrete) and, in EViT, weighs the fused token

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        n = state.num_patch_tokens
        k = self.num_kept(n)
        if k >= n:
            return state
        if state.keep_policy is not None:
            raise ValueError(f"{type(self).__name__} cannot follow a training-time keep_policy (DynamicViT training)")
        scores = ranking_scores(attention, state.num_prefix)  # (B, N), prefix raised
        if self.attributing and self.constant_ranking_scores:
            scores = scores.detach()  # same values; relevance takes them as constants (Reducer doc)
        # topk, not a full sort: only the k best are needed (ties, which float scores do not make, may stand either way)
        return self.reduce(state, scores, scores.topk(state.num_prefix + k, dim=1).indices)

    def reduce(self, state: TokenState, scores: Tensor, index: Tensor) -> TokenState:
        """Keep the tokens ``index`` (B, p + k): the p prefix tokens, then the k best patch tokens by descending
        ``scores`` (B, N) (:func:`ranking_scores`: token indices, prefix raised)."""
        raise NotImplementedError
