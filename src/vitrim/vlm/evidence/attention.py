"""Attention evidence of a vision tower's scoring layer, from its queries and keys (however the engine made them).

- Towers with a [CLS] (CLIP: LLaVA): the softmax row of [CLS] over the image tokens, and the layer's keys
  (FasterVLM, VisPruner, VisionZip, SCOPE read these, as their authors do at the tower's layer −2).
- Towers without one (SigLIP: Gemma 3; Qwen's ViT): the attention each token RECEIVES, per head, summed over the
  queries (the toolkits' stand-in for [CLS]'s row); Qwen packs every image of a call into one sequence of attention
  segments (whole images, or windows), so :func:`received_by_segment` scores each segment alone.

Queries are taken in chunks of :data:`QUERY_CHUNK` rows, so the map of a tower of thousands of patches is never
held whole (H · 256 · n values, not H · n²). Half precision is scored in float32, as the math backend accumulates.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

QUERY_CHUNK = 256


def cls_attention_and_keys(query: Tensor, keys: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """[CLS]'s softmax attention row and the image tokens' keys.

    query: (I, H, 1, hd) [CLS]'s query; keys: (I, H, 1 + N, hd) the keys of [CLS] and the N image tokens.
    Returns ((I, H, N) the row over [CLS] and the N tokens with [CLS]'s own weight left out, so it sums to < 1;
    (I, H, N, hd) the keys of the N tokens).
    """
    row = torch.softmax((query @ keys.transpose(-1, -2)) * scale, dim=-1)  # (I, H, 1, 1 + N)
    return row[:, :, 0, 1:], keys[:, :, 1:]


def received_attention(query: Tensor, key: Tensor, scale: float, bias: Tensor | None = None) -> Tensor:
    """(…, H, N): per head, the softmax attention each of the N keys receives, summed over the N queries.

    query, key: (…, H, N, hd); bias: None or additive logits broadcastable to (…, H, N, N) (a tower stage's
    (B, 1, 1, N) log-sizes after a merge). Divide by N for the mean over the queries.
    """
    work = torch.promote_types(query.dtype, torch.float32)
    query, key = query.to(work), key.to(work)
    length = query.shape[-2]
    received = query.new_zeros(query.shape[:-1])  # (…, H, N)
    for start in range(0, length, QUERY_CHUNK):
        logits = query[..., start : start + QUERY_CHUNK, :] @ key.transpose(-1, -2) * scale  # (…, H, r, N)
        if bias is not None:
            rows = bias if bias.shape[-2] == 1 else bias[..., start : start + QUERY_CHUNK, :]
            logits = logits + rows.to(work)
        received += logits.softmax(dim=-1).sum(dim=-2)
    return received


def received_by_segment(query: Tensor, key: Tensor, bounds: Tensor, scale: float) -> Tensor:
    """(H, P): :func:`received_attention` of a packed sequence whose segments attend only within themselves.

    query, key: (P, H, hd); bounds: (S + 1,) the segments' edges (Qwen's ``cu_seqlens``: segment s spans rows
    ``bounds[s] … bounds[s+1]``). A patch's value is the attention mass it receives from its segment's queries.
    """
    received = query.new_zeros(query.shape[1], query.shape[0])  # (H, P)
    for start, end in itertools.pairwise(bounds.tolist()):
        segment = slice(start, end)
        received[:, segment] = received_attention(
            query[segment].transpose(0, 1), key[segment].transpose(0, 1), scale
        )  # (H, n)
    return received


def rotate_half(x: Tensor) -> Tensor:
    """The rotary embedding's half rotation (−x₂, x₁) over the last dimension (transformers' and Qwen's)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
