"""Gemma 3's per-layer-type attention masks for a shortened LLM input (prefill and the decode steps after it).

Gemma 3's LLM takes a dict of masks, one per layer type: ``"full_attention"`` (causal OR the image block:
``token_type_ids`` make the tokens of one image attend to each other both ways) and ``"sliding_attention"`` (the
same AND key within ``sliding_window`` columns of the query). ``Gemma3Model`` builds it from the full-length
input before the LLM runs; transformers measures the window in columns of the sequence, which for a shortened
input would count kept tokens, not the original distance. So vitrim never lets transformers build the masks of a
shortened sequence:

- at the prefill, :func:`gather_masks` takes the masks the unmodified model built (full length, token types
  included) and gathers the kept rows and columns: dropping a token is then exactly masking its key, the image
  block and the window as the unmodified model has them;
- at a decode step, :func:`decode_masks` builds each layer type's mask over the keys that layer's cache holds
  (``cache.get_mask_sizes``: a sliding layer keeps only its last ``window − 1`` keys): a key is seen when the
  caller's mask allows it, it is not after the query, and (sliding layers) its ORIGINAL position is within the
  window of the query's. Decode steps carry no image tokens (generate passes no token types after the prefill), so
  no image block is needed there.

Masks are in the form the attention implementation reads: bool (SDPA) or additive float (eager).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vitrim.vlm.stages.filler_masks import as_additive, with_filler_rows
from vitrim.vlm.stages.sequence import ShortSequence


def _as_implementation(allowed: Tensor, like: Tensor | None, dtype: torch.dtype, implementation: str) -> Tensor:
    """(B, 1, q, kv) bool -> the mask type of ``like`` (a transformers mask) or of ``implementation``."""
    additive = like.is_floating_point() if like is not None else implementation == "eager"
    if not additive:
        return allowed
    return as_additive(allowed, like.dtype if like is not None else dtype)


def _causal_window(length: int, batch: int, window: int | None, device: torch.device) -> Tensor:
    """(B, 1, L, L) bool: the causal (and sliding-window) mask of a sequence without padding or images."""
    index = torch.arange(length, device=device)
    allowed = index[None, :] <= index[:, None]
    if window is not None:
        allowed = allowed & (index[:, None] - index[None, :] < window)
    return allowed[None, None].expand(batch, 1, length, length)


def gather_masks(
    masks: dict[str, Tensor | None], short: ShortSequence, window: int | None, implementation: str, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The masks of the shortened prefill (B, 1, L', L') from the unmodified model's (B|1, 1, L, L) masks.

    A mask transformers left as None (plain causal, no padding: SDPA's own ``is_causal``) is made explicit first.
    Filler columns (re-padding) are no one's key; a filler row sees only itself (a row with no key would be NaN).
    """
    batch, short_length = short.columns.shape
    length = short.full_length
    device = short.columns.device
    out = {}
    for layer_type, mask in masks.items():
        if mask is None:
            full = _causal_window(length, batch, window if layer_type == "sliding_attention" else None, device)
        else:
            full = mask.expand(batch, *mask.shape[1:])
        rows = short.columns[:, None, :, None].expand(batch, full.shape[1], short_length, full.shape[-1])
        gathered = full.gather(2, rows)  # (B, 1, L', L)
        cols = short.columns[:, None, None, :].expand(batch, full.shape[1], short_length, short_length)
        gathered = gathered.gather(3, cols)  # (B, 1, L', L')
        if gathered.is_floating_point():
            allowed = gathered == 0
        else:
            allowed = gathered.bool()
        allowed = with_filler_rows(allowed, short.real)
        out[layer_type] = _as_implementation(allowed, mask, dtype, implementation)
    return out


def decode_masks(
    cache: Any,
    layer_types: list[str],
    mask_2d: Tensor,
    positions: Tensor,
    query_length: int,
    window: int | None,
    implementation: str,
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """Each layer type's mask (B, 1, q, kv) for a decode step on a shortened prefill's cache.

    mask_2d: (B, S) the caller's mask in the cache's layout (short prefill + steps, this step's q columns last);
    positions: (B, S) the original position of every column of that layout.
    """
    total = mask_2d.shape[1]
    out = {}
    for layer_type in set(layer_types):
        layer = layer_types.index(layer_type)
        kv_length, kv_offset = cache.get_mask_sizes(query_length, layer)
        keys = torch.arange(kv_offset, kv_offset + kv_length, device=mask_2d.device)  # (kv,) columns of the layout
        queries = torch.arange(total - query_length, total, device=mask_2d.device)  # (q,)
        allowed = (keys[None, :] <= queries[:, None])[None] & mask_2d[:, keys].bool()[:, None, :]  # (B, q, kv)
        if layer_type == "sliding_attention" and window is not None:
            distance = positions[:, queries][:, :, None] - positions[:, keys][:, None, :]  # (B, q, kv)
            allowed = allowed & (distance < window)
        out[layer_type] = _as_implementation(allowed[:, None], None, dtype, implementation)
    return out
