"""A chance baseline: keep a random subset of the patch tokens, at exactly top-k's counts and blocks.

A method that scores tokens should beat this at the same compute; ``vitrim bench reducers`` rows it beside every
method at matched GMACs. Counts, blocks and options are top-k's (:mod:`vitrim.reduce.cls_ranking`: ``keep_rate`` or
``keep_count``, a quarter, half and three quarters deep by default), plus ``seed``.

Which tokens: the k patch tokens with the highest of a pseudo-random score u_t in [0, 1) of the token index t, hashed
from (``seed``, the block, the token count): reproducible, a deterministic function of the input like every other
reducer, the same for every image of a batch (so a batch of one computes what the batch does) and different for
every block and seed. The hash is integer arithmetic (a Lehmer step and two squarings modulo the prime 2³¹ − 1), so
the kept indices are one constant per shape: the reducer makes no host calls beyond the gather, compiles and exports.
No [CLS] is needed. Kept tokens stand in descending score, prefix tokens first.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from vitrim.attention import AttentionResult
from vitrim.reduce.base import Reducer
from vitrim.reduce.cls_ranking import ClsRankingReducer
from vitrim.reduce.index_cache import cached
from vitrim.reduce.registry import register
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import keep_rows

PRIME = 2**31 - 1  # products of two residues stay below 2⁶² (int64)


def random_scores(num_tokens: int, salt: int, device: torch.device | None = None) -> Tensor:
    """(N,) float64 pseudo-random scores in [0, 1) of the token indices 0 … N−1, a function of ``salt`` only."""
    x = (torch.arange(num_tokens, dtype=torch.int64, device=device) * 48271 + salt) % PRIME
    x = (x * x + 12345) % PRIME
    x = (x * x + 54321) % PRIME
    return ((x * 48271) % PRIME).to(torch.float64) / PRIME


def random_keep_index(num_tokens: int, num_prefix: int, k: int, salt: int, device: torch.device) -> Tensor:
    """(1, p + k) long: the p prefix tokens in order, then the k patch tokens with the highest random scores."""
    scores = random_scores(num_tokens, salt, device)
    ranks = torch.arange(num_tokens, device=device)
    raised = (2 + num_prefix - ranks).to(scores.dtype)  # 2 + p − i: above every score, decreasing
    scores = torch.where(ranks < num_prefix, raised, scores)  # prefix first, in order
    return scores.topk(num_prefix + k).indices[None]


@register("random")
class RandomKeep(ClsRankingReducer):
    """Keep k random patch tokens (seeded, reproducible) at top-k's counts; drop the others. See module doc."""

    needs_cls_token = False

    def __init__(self, keep_rate: float = 0.7, keep_count: int | None = None, seed: int = 0) -> None:
        super().__init__(keep_rate, keep_count)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**20:
            raise ValueError(f"seed must be an int in [0, 2**20), got {seed!r}")
        self.seed = seed
        self.block = 0  # this instance's block, a salt of the hash: set by for_layers

    @classmethod
    def for_layers(cls, layers: tuple[int, ...], **options: Any) -> dict[int, Reducer | None]:
        """top-k's, each instance told its block (so that two blocks at the same count draw different subsets)."""
        reducers = super().for_layers(layers, **options)
        for layer, reducer in reducers.items():
            cast(RandomKeep, reducer).block = layer
        return reducers

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        N, p = state.tokens.shape[1], state.num_prefix
        k = self.num_kept(N - p)
        if k >= N - p:
            return state
        if state.keep_policy is not None:
            raise ValueError("RandomKeep cannot follow a training-time keep_policy (DynamicViT training)")
        salt = (self.seed * 1_000_003 + self.block * 7919 + N) % PRIME
        device = state.tokens.device
        index = cached(("random_keep", N, p, k, salt, device), lambda: random_keep_index(N, p, k, salt, device))
        return keep_rows(state, index.expand(state.tokens.shape[0], -1))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, seed={self.seed}"
