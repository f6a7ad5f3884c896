"""The token operations every reducer shares: move rows fast, keep or merge tokens, record provenance.

Row moves: ``x.gather(1, index[..., None].expand(-1, -1, C))`` is the textbook form, but on CPU it walks every
element through its index (measured 15 ms for 32 × 184 rows of 384 floats); flattening the batch and using
``index_select`` / ``index_add_`` copies whole rows (under 1 ms for the same rows). Same results, exactly.

Merges (:func:`merge_rows`): at batch 1 in eager mode, one product with the one-hot assignment matrix
(``einsum``) instead of a gather, a scatter and their index arithmetic: a batch-1 forward is bound by the host's
calls, not by arithmetic (on a GPU each call costs 20–30 µs whatever its size), and the product's extra
multiply-adds (N·N'·C, about 1.5 % of a ViT-B block) cost less than the calls it saves. Above batch 1 the rows move
(``index_add_``), where arithmetic is the cost.

Provenance: a reducer describes what it did to the patch tokens with ``dest`` (B, n) long: for each of the n patch
tokens that entered it, the index of the patch token that now stands for it (−1 if dropped). Composing ``dest``
with the previous (B, P) map gives the new one; one (B, P) map per reduction is appended to
``TokenState.patch_to_token`` (see :mod:`vitrim.reduce.state`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrim.reduce.index_cache import batch_offsets, cached, cached_arange, cached_eye
from vitrim.reduce.state import TokenState


def flat_index(index: Tensor, rows_per_batch: int) -> Tensor:
    """(B, K) row indices within each batch element -> (B·K,) indices into the flattened (B·rows, …) tensor."""
    return (index + batch_offsets(index.shape[0], rows_per_batch, device=index.device)).flatten()


def single_image(t: Tensor) -> bool:
    """Whether ``t`` (B, …) is one image in eager mode, where the fewest calls win: rows move along dim 1 directly
    and merges are one-hot products; a traced graph keeps one form for any B."""
    return t.shape[0] == 1 and not torch.compiler.is_compiling()


def take_rows(x: Tensor, index: Tensor) -> Tensor:
    """x (B, N, C), index (B, K) long in [0, N) -> (B, K, C) with out[b, j] = x[b, index[b, j]]."""
    if single_image(index):
        return x.index_select(1, index.view(-1))
    B, N, C = x.shape
    return x.reshape(B * N, C).index_select(0, flat_index(index, N)).view(B, index.shape[1], C)


def add_rows_(out: Tensor, index: Tensor, rows: Tensor) -> Tensor:
    """In place: out[b, index[b, j]] += rows[b, j] (repeated indices accumulate). out (B, N, C) contiguous."""
    if single_image(index):
        return out.index_add_(1, index.view(-1), rows)
    B, N, C = out.shape
    out.view(B * N, C).index_add_(0, flat_index(index, N), rows.reshape(-1, C))
    return out


def merge_rows(x: Tensor, dest: Tensor, num_out: int, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Weighted means of groups of rows: out[b, j] = Σ_{t: dest[b, t] = j} w[b, t] x[b, t] / Σ_{…} w[b, t].

    x (B, N, C); dest (B, N) long in [0, num_out), every output row receiving at least one row; weights (B, N) (the
    token sizes; None: all ones). Returns out (B, num_out, C) and the summed weights (B, num_out) (in the weights'
    dtype). One product with the one-hot assignment at batch 1 in eager mode, rows moved otherwise (module doc).
    """
    B, N, C = x.shape
    if single_image(dest):
        assign = F.embedding(dest, cached_eye(num_out, dtype=x.dtype, device=x.device))  # (1, N, N') one-hot rows
        if weights is None:
            totals = assign.sum(dim=1)  # (1, N')
            return torch.einsum("bnk,bnc,bk->bkc", assign, x, totals.reciprocal()), totals
        w = weights if weights.dtype == x.dtype else weights.to(x.dtype)
        totals = torch.einsum("bnk,bn->bk", assign, w)  # (1, N')
        out = torch.einsum("bnk,bn,bnc,bk->bkc", assign, w, x, totals.reciprocal())
        return out, totals if totals.dtype == weights.dtype else totals.to(weights.dtype)
    w = x.new_ones(B, N) if weights is None else weights
    out = x.new_zeros(B, num_out, C)
    add_rows_(out, dest, x * w[..., None].to(x.dtype))
    totals = w.new_zeros(B, num_out).scatter_add_(1, dest, w)
    return out / totals[..., None].to(x.dtype), totals


def group_sums(dest: Tensor, num_out: int, values: Tensor) -> Tensor:
    """(B, num_out): Σ_{t: dest[b, t] = j} values[b, t], for dest and values (B, N) (as :func:`merge_rows` sums)."""
    if single_image(dest):
        assign = F.embedding(dest, cached_eye(num_out, dtype=values.dtype, device=values.device))  # (1, N, N')
        return torch.einsum("bnk,bn->bk", assign, values)
    return values.new_zeros(dest.shape[0], num_out).scatter_add_(1, dest, values)


def with_prefix(keep: Tensor, num_prefix: int) -> Tensor:
    """Patch-token indices (B, k) -> token indices (B, num_prefix + k) with the prefix tokens first."""
    if num_prefix == 0:
        return keep
    B = keep.shape[0]
    prefix = cached(
        ("prefix", B, num_prefix, keep.device), lambda: torch.arange(num_prefix, device=keep.device).repeat(B, 1)
    )
    return torch.cat([prefix, keep + num_prefix], dim=1)


def keep_destinations(keep: Tensor, n: int, rest: int) -> Tensor:
    """(B, n) new patch-token index of each old one: keep[:, j] -> j, every other token -> ``rest`` (−1: dropped)."""
    B, k = keep.shape
    new = cached_arange(0, k, device=keep.device).expand(B, k)
    return torch.full((B, n), rest, dtype=torch.long, device=keep.device).scatter_(1, keep, new)


def current_patch_to_token(state: TokenState) -> Tensor | None:
    """(B, P) long: the patch token (0 … n−1) standing for each patch of the grid now, −1 if dropped; None if unknown.

    Before any tracked reduction the map is read from ``positions``: patch ``positions[b, j]`` is token j. That needs
    the grid size P: ``state.grid_patches``, or n when no reduction removed a token yet. A reducer that removed tokens
    without tracking them (and no grid size) leaves the map unknown, and tracking stops rather than guessing.
    """
    if state.patch_to_token:
        return state.patch_to_token[-1]
    positions = state.positions  # (B, n)
    if positions is None:  # not tracked (no provenance is recorded)
        return None
    B, n = positions.shape
    P = state.grid_patches
    if P is None:
        if state.kept_indices:
            return None
        P = n
    tokens = cached_arange(0, n, device=positions.device).expand(B, n)
    return torch.full((B, P), -1, dtype=torch.long, device=positions.device).scatter_(1, positions, tokens)


def record_reduction(state: TokenState, dest: Tensor) -> tuple[Tensor, ...]:
    """The state's ``patch_to_token`` with one more map, after a reduction that sent patch token j to ``dest[:, j]``.

    dest: (B, n) long, n = the patch tokens before the reduction; −1 = dropped. Nothing is recorded once
    ``state.trace`` is off, nor when the state records no provenance (``state.record``).
    """
    if not (state.trace and state.record):
        return state.patch_to_token
    before = current_patch_to_token(state)  # (B, P)
    if before is None:
        return state.patch_to_token
    after = dest.gather(1, before.clamp_min(0))  # (B, P)
    after = torch.where(before < 0, before, after)  # a patch dropped earlier stays dropped
    return (*state.patch_to_token, after)


def keep_tokens(
    state: TokenState, keep: Tensor, *, fused: Tensor | None = None, fused_position: Tensor | None = None
) -> TokenState:
    """The state with only the prefix and the patch tokens ``keep`` (B, k) (indices among the n patch tokens).

    Tokens, sizes, the keep policy and (when tracked) positions and fused flags follow the kept tokens, in the order
    of ``keep``; when provenance is recorded, the kept absolute positions are appended to ``kept_indices`` (−1 for a
    kept fused token) and the reduction to ``patch_to_token``.

    With ``fused`` (B, 1, C), that token is appended after the kept ones and stands for every patch token not kept
    (EViT): its position is ``fused_position`` (B, 1) (needed only where positions are tracked), its size the sum of
    theirs, and ``patch_to_token`` sends their patches to it; it is flagged in ``TokenState.fused``.
    """
    return keep_rows(state, with_prefix(keep, state.num_prefix), fused=fused, fused_position=fused_position)


def keep_rows(
    state: TokenState, index: Tensor, *, fused: Tensor | None = None, fused_position: Tensor | None = None
) -> TokenState:
    """:func:`keep_tokens` for token indices ``index`` (B, p + k) that list the p prefix tokens first, in order."""
    p = state.num_prefix
    x = state.tokens  # (B, N, C)
    n = x.shape[1] - p
    tokens = take_rows(x, index)  # (B, p + k, C), one pass over the kept rows
    sizes = None if state.sizes is None else state.sizes.gather(1, index)
    keep_policy = None if state.keep_policy is None else state.keep_policy.gather(1, index)
    positions, was_fused = state.positions, None
    keep = index[:, p:] - p if positions is not None or state.record else None  # (B, k) patch-token indices
    if keep is not None and positions is not None:
        positions = positions.gather(1, keep)  # (B, k)
    if keep is not None and state.record and state.fused is not None:
        was_fused = state.fused.gather(1, keep)  # (B, k)
    if fused is not None:
        tokens = torch.cat([tokens, fused if fused.dtype == tokens.dtype else fused.to(tokens.dtype)], dim=1)
        if state.sizes is not None and sizes is not None:
            fused_size = state.sizes[:, p:].sum(1, keepdim=True) - sizes[:, p:].sum(1, keepdim=True)
            sizes = torch.cat([sizes, fused_size], dim=1)
        if keep_policy is not None:
            keep_policy = torch.cat([keep_policy, keep_policy.new_ones(keep_policy.shape[0], 1)], dim=1)
    kept_positions = positions
    if fused is not None and positions is not None:
        if fused_position is None:
            raise ValueError("keep_tokens: a fused token needs its fused_position (B, 1)")
        positions = torch.cat([positions, fused_position], dim=1)
    if not state.record:
        return state.replace(tokens=tokens, sizes=sizes, keep_policy=keep_policy, positions=positions)
    assert keep is not None and kept_positions is not None
    if was_fused is not None:
        kept_positions = kept_positions.masked_fill(was_fused, -1)
    if fused is not None:
        flags = torch.zeros_like(keep, dtype=torch.bool) if was_fused is None else was_fused
        was_fused = torch.cat([flags, flags.new_ones(flags.shape[0], 1)], dim=1)
    rest = -1 if fused is None else keep.shape[1]
    return state.replace(
        tokens=tokens,
        positions=positions,
        sizes=sizes,
        fused=was_fused,
        keep_policy=keep_policy,
        kept_indices=(*state.kept_indices, kept_positions),
        patch_to_token=record_reduction(state, keep_destinations(keep, n, rest)),
    )
