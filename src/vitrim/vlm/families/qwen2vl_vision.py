"""What the Qwen2-VL / Qwen2.5-VL vision tower tells a pre-LLM method, per image, in the index space of the LLM.

Conventions (owned here):

- **The image tokens are the merger's outputs.** The tower sees patches (Qwen: 14 px, temporal pairs of frames)
  and its ``PatchMerger`` turns each 2×2 block of them into one token for the LLM. The index space of every
  selection is the raster order of those merged tokens, ``(t, h / m, w / m)`` row-major with m the
  ``spatial_merge_size`` - the order the unmodified model writes them into the LLM input.
- **Tower order.** The processor lays out ``pixel_values`` so that the m² patches of a merged token are adjacent
  (``get_vision_position_ids``), and Qwen2-VL keeps that order through its blocks: group g of m² rows is merged
  token g. Qwen2.5-VL permutes the groups into windows before its first block (``window_index``: row group g of the
  blocks is merged token ``window_index[g]``) and un-permutes after the merger; we un-permute alike.
- **No [CLS].** The [CLS]-based methods (FasterVLM, VisPruner, VisionZip) rank by [CLS]'s attention row; this tower
  has no [CLS], so, as the token-reduction toolkits do for Qwen, a token's score is the attention it RECEIVES at
  the scoring block: the softmax map of that block (per head, over the block's own attention segments: the whole
  image in a full-attention block, a window in Qwen2.5's windowed blocks), summed over the queries and divided by
  the image's patch count (the mean over the image's queries; a windowed block's map is zero outside the window),
  then summed over the m² patches of each merged token. Per image and head the scores sum to 1. The map comes from
  the block's own q/k (its ``qkv`` projection and rotary embedding on the block's input), computed here once, so
  the tower keeps running on SDPA; it costs one H·n² map per attention segment (queries in chunks).
- **Features and keys.** ``features`` of a merged token are its m² patch states entering the merger, concatenated
  (m²·C): what the merger - Qwen's projector - reads, so a token merged from several is their mean put through the
  merger. ``keys`` are the scoring block's keys before rotary (content, not position), averaged over the m² patches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

QUERY_CHUNK = 256  # rows of the attention map formed at once: H · 256 · n values, not H · n² (n: 1000s of patches)


@dataclass(frozen=True)
class ScoringCapture:
    """The scoring block's attention evidence over all patches of one tower call, in tower order (P patches).

    received: (H, P)      per head, the attention each patch receives, summed over the queries of its segment
    keys: (P, H, hd)      the block's keys before rotary
    """

    received: Tensor
    keys: Tensor


@dataclass(frozen=True)
class ImageEvidence:
    """One image's evidence in merged-token raster order (N merged tokens, m² patches each).

    features: (N, m²·C)   the merger's input, the m² patch states of each merged token concatenated
    received: (H, N)      attention received at the scoring block, per head (sums to 1 over N per head)
    keys: (H, N, hd)      the scoring block's keys before rotary, averaged over each token's m² patches
    (received and keys are None when the scoring block was not captured: a method that needs no attention)
    """

    features: Tensor
    received: Tensor | None
    keys: Tensor | None


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def received_attention(query: Tensor, key: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """Column sums of the per-segment softmax attention map, per head: (H, P) from query/key (P, H, hd).

    Segment s spans rows ``cu_seqlens[s] … cu_seqlens[s+1]`` and attends only within itself (Qwen's packed vision
    attention); a patch's value is the attention mass it receives from all queries of its segment.
    """
    num_patches, num_heads, _ = query.shape
    received = query.new_zeros(num_heads, num_patches)  # (H, P)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        seg_keys = key[start:end].transpose(0, 1)  # (H, n, hd)
        for row in range(start, end, QUERY_CHUNK):
            rows = query[row : min(row + QUERY_CHUNK, end)].transpose(0, 1)  # (H, r, hd)
            weights = torch.softmax(rows @ seg_keys.transpose(1, 2) * scale, dim=-1)  # (H, r, n)
            received[:, start:end] += weights.sum(dim=1)
    return received


def capture_scoring_block(
    attention: Any, hidden: Tensor, cu_seqlens: Tensor, rotary: tuple[Tensor, Tensor]
) -> ScoringCapture:
    """Recompute the scoring block's q/k from its input (the ``attn`` module's own ``qkv`` and rotary) and score.

    hidden: (P, C) the block's normed input in tower order; rotary: (cos, sin), each (P, hd), as the block gets them.
    """
    num_patches = hidden.shape[0]
    num_heads = int(attention.num_heads)
    work = torch.promote_types(hidden.dtype, torch.float32)  # a half-precision tower's map is scored in float32
    qkv = attention.qkv(hidden).reshape(num_patches, 3, num_heads, -1).to(work)  # (P, 3, H, hd)
    query, key = qkv[:, 0], qkv[:, 1]  # (P, H, hd) each
    cos, sin = (r.to(work).unsqueeze(-2) for r in rotary)  # (P, 1, hd)
    query_rot = query * cos + rotate_half(query) * sin
    key_rot = key * cos + rotate_half(key) * sin
    received = received_attention(query_rot, key_rot, cu_seqlens, float(attention.scaling))  # (H, P)
    return ScoringCapture(received=received, keys=key)


def merged_order(window_index: Tensor | None, num_groups: int, device: torch.device) -> Tensor:
    """(G,) long: the merged-token index (raster, over all images) of each row group of the tower's blocks."""
    if window_index is None:
        return torch.arange(num_groups, device=device)
    return window_index.to(device)


def image_evidence(
    capture: ScoringCapture | None,
    tower_states: Tensor,
    grid_thw: Tensor,
    merge_size: int,
    window_index: Tensor | None,
) -> list[ImageEvidence]:
    """Split one tower call's evidence per image, in merged-token raster order.

    tower_states: (P, C) the last block's output in tower order (the merger's input); grid_thw: (I, 3) in patches.
    """
    unit = merge_size * merge_size
    num_patches, channels = tower_states.shape
    num_groups = num_patches // unit
    order = merged_order(window_index, num_groups, tower_states.device)  # (G,) tower group -> raster group

    def to_raster(grouped: Tensor) -> Tensor:  # (G, ...) in tower order -> (G, ...) in raster order
        raster = torch.empty_like(grouped)
        raster[order] = grouped
        return raster

    features = to_raster(tower_states.reshape(num_groups, unit * channels))  # (G, m²C)
    received = keys = None
    if capture is not None:
        num_heads = capture.received.shape[0]
        received = to_raster(capture.received.reshape(num_heads, num_groups, unit).sum(-1).T)  # (G, H)
        keys = to_raster(capture.keys.reshape(num_groups, unit, num_heads, -1).mean(1))  # (G, H, hd)

    evidence = []
    start = 0
    for patches in grid_thw.prod(-1).tolist():
        stop = start + patches // unit
        evidence.append(
            ImageEvidence(
                features=features[start:stop],
                # (H, N): summed over the image's queries -> their mean; (H, N, hd)
                received=None if received is None else received[start:stop].T / patches,
                keys=None if keys is None else keys[start:stop].transpose(0, 1),
            )
        )
        start = stop
    return evidence
