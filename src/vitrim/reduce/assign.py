"""Merging by assignment: the export-safe merge that PiToMe, MCTF and PPT's pooling share.

A merge of the n patch tokens entering a reducer into n' is described by

* ``keep`` (B, n') long: for each output row, the patch token it continues (its anchor: position, order);
* ``src`` (B, r) long: the patch tokens merged away, and ``src_dest`` (B, r) long: the output row each one joins;

and computed as a weighted mean (weights w, by default the token sizes, as ToMe's ``merge_wavg``):

    out_j = (w_{keep_j} x_{keep_j} + Σ_{i: src_dest_i = j} w_i x_i) / (w_{keep_j} + Σ_{i: src_dest_i = j} w_i)

with gathers and one dense assignment product ``A^T (w x)[src]``, A = one_hot(src_dest) (B, r, n'): no
``scatter_reduce`` (ONNX has no mean reduction), cost r · n' · C, small beside a block. Sizes add up; every patch of a
merged token maps to its output row in ``patch_to_token``; the output row keeps its anchor's position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import record_reduction, take_rows, with_prefix


def merge_destinations(keep: Tensor, src: Tensor, src_dest: Tensor, n: int) -> Tensor:
    """(B, n) long: the output row of every patch token (keep_j -> j, src_i -> src_dest_i); −1 for a token in neither
    (dropped)."""
    B, k = keep.shape
    dest = torch.full((B, n), -1, dtype=torch.long, device=keep.device)
    dest = dest.scatter(1, keep, torch.arange(k, device=keep.device).expand(B, k))
    return dest.scatter(1, src, src_dest)


def weighted_merge(x: Tensor, weights: Tensor, keep: Tensor, src: Tensor, src_dest: Tensor) -> tuple[Tensor, Tensor]:
    """x (B, n, C), weights (B, n) -> merged x (B, n', C) and summed weights (B, n') (see module doc)."""
    n_out = keep.shape[1]
    wx = x * weights[..., None].to(x.dtype)  # (B, n, C)
    assign = F.one_hot(src_dest, n_out).to(x.dtype)  # (B, r, n')
    total = take_rows(wx, keep) + assign.transpose(1, 2) @ take_rows(wx, src)  # (B, n', C)
    w_total = weights.gather(1, keep) + (assign.transpose(1, 2) @ weights.gather(1, src)[..., None].to(x.dtype))[..., 0]
    return total / w_total[..., None].to(x.dtype), w_total


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
    the summed sizes. ``proportional_attention``: set the state's flag (None: leave it).
    """
    p = state.num_prefix
    x = state.tokens  # (B, N, C)
    B, N, _ = x.shape
    n = N - p
    sizes = state.sizes if state.sizes is not None else x.new_ones(B, N)
    patch_sizes = sizes[:, p:]  # (B, n)
    w = patch_sizes if weights is None else weights
    merged, _ = weighted_merge(x[:, p:], w, keep, src, src_dest)  # (B, n', C)
    assign = F.one_hot(src_dest, keep.shape[1]).to(sizes.dtype)  # (B, r, n')
    new_sizes = patch_sizes.gather(1, keep) + (assign.transpose(1, 2) @ patch_sizes.gather(1, src)[..., None])[..., 0]
    tokens = torch.cat([x[:, :p], merged], dim=1)
    flag = state.size_bias if proportional_attention is None else proportional_attention
    return state.replace(
        tokens=tokens,
        positions=None if state.positions is None else state.positions.gather(1, keep),
        sizes=torch.cat([sizes[:, :p], new_sizes], dim=1),
        keep_policy=None if state.keep_policy is None else state.keep_policy.gather(1, with_prefix(keep, p)),
        patch_to_token=record_reduction(state, merge_destinations(keep, src, src_dest, n)),
        size_bias=flag,
    )
