"""Top-k by [CLS] attention: keep the k patch tokens the [CLS] query attends to most, drop the rest (the baseline).

k = max(1, ⌊n · keep_rate⌋) of the n patch tokens that enter the block (a 1e-9 tolerance keeps 0.29 · 100 at 29);
prefix tokens are always kept. Kept tokens stand in descending order of attention, as EViT's ``torch.topk`` leaves
them; ``kept_indices`` gets their absolute patch positions in that order. With k = n the state passes through untouched.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vitrim.reduce.attention_row import cls_attention_to_patches
from vitrim.reduce.base import AttentionInfo, Reducer, TokenState
from vitrim.reduce.rows import take_rows
from vitrim.reduce.tracking import record_reduction


def check_keep_rate(keep_rate: object) -> float:
    """Validate a keep rate: a number in (0, 1]."""
    if isinstance(keep_rate, bool) or not isinstance(keep_rate, (int, float)) or not 0.0 < keep_rate <= 1.0:
        raise ValueError(f"keep_rate must be a number in (0, 1] (fraction of patch tokens kept), got {keep_rate!r}")
    return float(keep_rate)


def num_keep(num_patches: int, keep_rate: float) -> int:
    """k = max(1, ⌊num_patches · keep_rate⌋), with a 1e-9 tolerance against float round-off."""
    return max(1, min(num_patches, math.floor(num_patches * keep_rate + 1e-9)))


def rank_by_score(scores: Tensor) -> Tensor:
    """(B, n) scores -> (B, n) token indices, highest score first (stable, so ties keep token order)."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices


def with_prefix(keep: Tensor, num_prefix: int) -> Tensor:
    """Patch-token indices (B, k) -> token indices (B, num_prefix + k) with the prefix tokens first."""
    prefix = torch.arange(num_prefix, device=keep.device).expand(keep.shape[0], num_prefix)
    return torch.cat([prefix, keep + num_prefix], dim=1)


def keep_destinations(keep: Tensor, n: int, rest: int) -> Tensor:
    """(B, n) new patch-token index of each old one: keep[:, j] -> j, every other token -> ``rest`` (−1: dropped)."""
    B, k = keep.shape
    new = torch.arange(k, device=keep.device).expand(B, k)
    return torch.full((B, n), rest, dtype=torch.long, device=keep.device).scatter_(1, keep, new)


def check_state(state: TokenState, info: AttentionInfo | None, method: str) -> AttentionInfo:
    """The attention info a [CLS]-ranking reducer needs, with a clear error for states it cannot handle."""
    if info is None:
        raise ValueError(f"{method} needs the block's attention (q, k); run it as a 'mid' reducer inside a Block")
    if state.keep_policy is not None:
        raise ValueError(f"{method} cannot follow a training-time keep_policy (DynamicViT training); got one")
    return info


def keep_top_tokens(state: TokenState, keep: Tensor) -> TokenState:
    """The state with only the prefix and the patch tokens ``keep`` (B, k) (indices among the n patch tokens)."""
    p = state.num_prefix
    x = state.tokens  # (B, N, C)
    n = x.shape[1] - p
    tokens = take_rows(x, with_prefix(keep, p))  # (B, p + k, C), one pass over the kept rows
    positions = state.positions.gather(1, keep)  # (B, k)
    sizes = state.sizes
    if sizes is not None:
        sizes = torch.cat([sizes[:, :p], sizes[:, p:].gather(1, keep)], dim=1)
    return state.replace(
        tokens=tokens,
        positions=positions,
        sizes=sizes,
        kept_indices=(*state.kept_indices, positions),
        patch_to_token=record_reduction(state, keep_destinations(keep, n, -1)),
    )


class TopK(Reducer):
    """Keep the top-k patch tokens by [CLS] attention (mean over heads); drop the others. See module doc."""

    stage = "mid"
    needs_attention = True

    def __init__(self, keep_rate: float) -> None:
        self.keep_rate = check_keep_rate(keep_rate)

    def __call__(self, state: TokenState, info: AttentionInfo | None) -> TokenState:
        n = state.tokens.shape[1] - state.num_prefix
        k = num_keep(n, self.keep_rate)
        if k >= n:
            return state
        info = check_state(state, info, "top-k")
        scores = cls_attention_to_patches(info, state.num_prefix)  # (B, n)
        return keep_top_tokens(state, rank_by_score(scores)[:, :k])

    def extra_repr(self) -> str:
        return f"keep_rate={self.keep_rate}"
