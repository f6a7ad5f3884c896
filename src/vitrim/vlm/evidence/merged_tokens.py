"""Qwen's image tokens are its merger's outputs: the tower's evidence in the LLM's index space, per image.

Conventions (owned here, for every engine that runs a Qwen2-VL / Qwen2.5-VL / Qwen3-VL tower):

- **The image tokens are the merger's outputs.** The tower sees patches (14 px; a temporal patch of
  ``temporal_patch_size`` frames) and its ``PatchMerger`` turns each m×m block of them into one token for the LLM.
  The index space of every selection is the raster order of those merged tokens, ``(t, h / m, w / m)`` row-major
  (m: ``spatial_merge_size``), the order the unmodified model writes them into the LLM input.
- **Tower order.** The processor lays out the pixels so that the m² patches of a merged token are adjacent, and
  Qwen2-VL keeps that order through its blocks: group g of m² rows is merged token g. Qwen2.5-VL (and Qwen3-VL's
  windows) permute the groups before the first block (``window_index``: row group g of the blocks is merged token
  ``window_index[g]``) and un-permute after the merger; :func:`image_evidence` un-permutes alike.
- **No [CLS].** A token's score is the attention it RECEIVES at the scoring block
  (:func:`~vitrim.vlm.evidence.attention.received_by_segment` over the block's own segments), divided by the
  image's patch count (the mean over its queries) and summed over the m² patches of each merged token: per image and
  head the scores sum to 1.
- **Features and keys.** ``features`` of a merged token are its m² patch states entering the merger, concatenated
  (m²·C), what the merger reads, so a token merged from several is their mean put through the merger. ``keys`` are
  the scoring block's keys before rotary (content, not position), averaged over the m² patches.
- **Mean-query attention** (FastVID's salience, only for a method that asks: ``needs_query_attention``): per head and
  temporal patch, the softmax over its tokens of the temporal patch's mean query (over all its patches) · each
  token's mean key (over its m² patches), both after rotary, at the scoring block (:func:`mean_query_attention`);
  per temporal patch and head the scores sum to 1.
- **Video.** A temporal patch (``temporal_patch_size`` frames, 2 in every released checkpoint) is the unit of time:
  a video of grid (t, h, w) gives t temporal patches of (h / m)·(w / m) tokens each (:func:`temporal_patches`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TowerAttention:
    """The scoring block's attention evidence over every patch of one tower call, in tower order (P patches).

    received: (H, P) | None  per head, the attention each patch receives, summed over the queries of its segment
                          (None where the method reads the mean-query attention instead)
    keys: (P, H, hd)      the block's keys before rotary
    group_queries: (G, H, hd) | None  the block's queries after rotary times its scaling, averaged over each row
                          group of m² patches (G = P / m², tower order); None unless the method reads
                          :attr:`ImageEvidence.query_attention` (an engine that serves no such method gives none)
    group_keys: (G, H, hd) | None     its keys after rotary, averaged alike
    """

    received: Tensor | None
    keys: Tensor
    group_queries: Tensor | None = None
    group_keys: Tensor | None = None


@dataclass(frozen=True)
class ImageEvidence:
    """One image's evidence in merged-token raster order (N merged tokens, m² patches each).

    features: (N, m²·C)       the merger's input, the m² patch states of each merged token concatenated
    received: (H, N) | None   attention received at the scoring block, per head (sums to 1 over N per head)
    keys: (H, N, hd) | None   the scoring block's keys before rotary, averaged over each token's m² patches
    grid: (rows, columns)     the token grid of one temporal patch ((h / m, w / m): rows · columns · t = N)
    query_attention: (H, N) | None  :func:`mean_query_attention` of each temporal patch (sums to 1 over its tokens
                              per head); None unless the scoring block's ``group_queries`` were captured
    (received and keys are None when the scoring block was not captured: a method that reads no attention)
    """

    features: Tensor
    received: Tensor | None
    keys: Tensor | None
    grid: tuple[int, int]
    query_attention: Tensor | None = None


def merged_order(window_index: Tensor | None, num_groups: int, device: torch.device) -> Tensor:
    """(G,) long: the merged-token index (raster, over all images) of each row group of the tower's blocks."""
    if window_index is None:
        return torch.arange(num_groups, device=device)
    return window_index.to(device)


def mean_query_attention(queries: Tensor, keys: Tensor, frames: int) -> Tensor:
    """(H, N) per head: for each of the ``frames`` temporal patches, the softmax over its N / t tokens of the mean of
    its tokens' ``queries`` · each token's ``keys``.

    queries, keys: (H, N, hd) in raster order (t temporal patches of N / t tokens), the queries already scaled; each
    token's the mean over its m² patches, so the mean over a temporal patch's tokens is the mean over its patches.
    """
    heads, count, width = queries.shape
    per_frame = count // frames
    mean_query = queries.reshape(heads, frames, per_frame, width).mean(2, keepdim=True)  # (H, t, 1, hd)
    logits = mean_query @ keys.reshape(heads, frames, per_frame, width).transpose(-2, -1)  # (H, t, 1, N / t)
    return logits.softmax(-1).reshape(heads, count)


def tokens_per_image(grid_thw: Tensor, merge_size: int) -> list[int]:
    """Merged tokens per image (I,) of ``grid_thw`` (I, 3) in patches."""
    return (grid_thw.prod(-1) // (merge_size * merge_size)).tolist()


def image_evidence(
    attention: TowerAttention | None,
    tower_states: Tensor,
    grid_thw: Tensor,
    merge_size: int,
    window_index: Tensor | None,
) -> list[ImageEvidence]:
    """Split one tower call's evidence per image, in merged-token raster order.

    tower_states: (P, C) the merger's input in tower order; grid_thw: (I, 3) in patches; window_index: (G,) or None
    (no window permutation).
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
    received = keys = group_queries = group_keys = None
    if attention is not None:
        num_heads = attention.keys.shape[1]
        if attention.received is not None:
            received = to_raster(attention.received.reshape(num_heads, num_groups, unit).sum(-1).T)  # (G, H)
        keys = to_raster(attention.keys.reshape(num_groups, unit, num_heads, -1).mean(1))  # (G, H, hd)
        if attention.group_queries is not None and attention.group_keys is not None:
            group_queries = to_raster(attention.group_queries).transpose(0, 1)  # (H, G, hd)
            group_keys = to_raster(attention.group_keys).transpose(0, 1)

    evidence = []
    start = 0
    for (frames, height, width), patches in zip(grid_thw.tolist(), grid_thw.prod(-1).tolist(), strict=True):
        stop = start + patches // unit
        query_attention = None
        if group_queries is not None and group_keys is not None:
            query_attention = mean_query_attention(group_queries[:, start:stop], group_keys[:, start:stop], frames)
        evidence.append(
            ImageEvidence(
                features=features[start:stop],
                # (H, N): summed over the image's queries -> their mean; (H, N, hd)
                received=None if received is None else received[start:stop].T / patches,
                keys=None if keys is None else keys[start:stop].transpose(0, 1),
                grid=(height // merge_size, width // merge_size),
                query_attention=query_attention,
            )
        )
        start = stop
    return evidence


def temporal_patches(tokens: Tensor, grid_thw: tuple[int, int, int], merge_size: int) -> Tensor:
    """One video's merged tokens (N, …) in raster order -> (t, (h / m)·(w / m), …): one row per temporal patch.

    grid_thw: the video's ``video_grid_thw`` row (t temporal patches of h × w patches); ``ValueError`` when N does
    not hold that grid.
    """
    frames, height, width = grid_thw
    per_frame = (height // merge_size) * (width // merge_size)
    if frames * per_frame != tokens.shape[0]:
        raise ValueError(
            f"a video of grid {tuple(grid_thw)} (merge {merge_size}) has {frames * per_frame} tokens; got "
            f"{tokens.shape[0]}"
        )
    return tokens.reshape(frames, per_frame, *tokens.shape[1:])


def kept_per_temporal_patch(kept: Tensor, grid_thw: tuple[int, int, int], merge_size: int) -> list[Tensor]:
    """A video's kept raster indices (k,) (``vitrim.vlm.last_selection``'s entry for it) -> per temporal patch, the
    indices kept within that temporal patch (0 … (h / m)·(w / m) − 1), t tensors (empty where none is kept).

    grid_thw: the video's ``video_grid_thw`` row; ``ValueError`` when an index lies outside the video."""
    frames, height, width = (int(v) for v in grid_thw)
    per_frame = (height // merge_size) * (width // merge_size)
    if len(kept) and not 0 <= int(kept.min()) <= int(kept.max()) < frames * per_frame:
        raise ValueError(
            f"kept indices {kept.tolist()} lie outside a video of grid {tuple(grid_thw)} (merge {merge_size})"
        )
    frame_of = kept // per_frame
    return [kept[frame_of == frame] - frame * per_frame for frame in range(frames)]
