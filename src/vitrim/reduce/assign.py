"""Merging by assignment: the export-safe merge that PiToMe and MCTF share.

A merge of the n patch tokens entering a reducer into n' is described by

* ``keep`` (B, n') long: for each output row, the patch token it continues (its anchor: position, order);
* ``src`` (B, r) long: the patch tokens merged away, and ``src_dest`` (B, r) long: the output row each one joins;

and computed as a weighted mean (weights w, by default the token sizes, as ToMe's ``merge_wavg``):

    out_j = (w_{keep_j} x_{keep_j} + Σ_{i: src_dest_i = j} w_i x_i) / (w_{keep_j} + Σ_{i: src_dest_i = j} w_i)

as one merge of every token into its output row (:func:`vitrim.reduce.tokens.merge_rows`: one assignment product at
batch 1, rows moved above it; no ``scatter_reduce``, which ONNX lacks for means). Sizes add up; every patch of a
merged token maps to its output row in ``patch_to_token``; the output row keeps its anchor's position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitrim.reduce.index_cache import cached
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import group_sums, merge_rows, record_reduction, with_prefix


def merge_destinations(keep: Tensor, src: Tensor, src_dest: Tensor, n: int) -> Tensor:
    """(B, n) long: the output row of every patch token (keep_j -> j, src_i -> src_dest_i); −1 for a token in neither
    (dropped)."""
    B, k = keep.shape
    rows = cached(("arange_rows", B, k, keep.device), lambda: torch.arange(k, device=keep.device).repeat(B, 1))
    dest = torch.full((B, n), -1, dtype=torch.long, device=keep.device)
    return dest.scatter_(1, keep, rows).scatter_(1, src, src_dest)


def merge_tokens(
    state: TokenState,
    keep: Tensor,
    src: Tensor,
    src_dest: Tensor,
    *,
    weights: Tensor | None = None,
    proportional_attention: bool | None = None,
) -> TokenState:
    """The state after merging its patch tokens (indices 0 … n−1 after the prefix) as ``keep``/``src``/``src_dest`` say.

    weights: (B, n) weights of the mean, default the sizes (ones if the state has none); the new sizes are always
    the summed sizes. ``proportional_attention``: set the state's flag (None: leave it). Every token, prefix included
    (each its own group), goes through one merge (:func:`vitrim.reduce.tokens.merge_rows`).
    """
    p = state.num_prefix
    x = state.tokens  # (B, N, C)
    n, k = x.shape[1] - p, keep.shape[1]
    patch_dest = merge_destinations(keep, src, src_dest, n)  # (B, n)
    dest = with_prefix(patch_dest, p)  # (B, N): prefix token i stays row i
    sizes = state.sizes
    if weights is None:
        tokens, new_sizes = merge_rows(x, dest, p + k, sizes)
    else:
        full = weights if p == 0 else torch.cat([x.new_ones(x.shape[0], p).to(weights.dtype), weights], dim=1)
        tokens, _ = merge_rows(x, dest, p + k, full)
        new_sizes = group_sums(dest, p + k, x.new_ones(x.shape[:2]) if sizes is None else sizes)
    flag = state.size_bias if proportional_attention is None else proportional_attention
    return state.replace(
        tokens=tokens,
        positions=None if state.positions is None else state.positions.gather(1, keep),
        sizes=new_sizes,
        keep_policy=None if state.keep_policy is None else state.keep_policy.gather(1, with_prefix(keep, p)),
        patch_to_token=record_reduction(state, patch_dest) if state.record else state.patch_to_token,
        size_bias=flag,
    )
