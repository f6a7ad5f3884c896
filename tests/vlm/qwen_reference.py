"""Independent references for the Qwen2-VL family, written from the model's definition, in raster order throughout.

- ``raster_patch_coords``: each processor patch's (h, w), from the layout the processor writes (m×m blocks adjacent).
- ``window_of``: Qwen2.5's attention window of each merged token (windows of ``window`` merged tokens a side).
- ``received_by_hand``: the scoring block's attention map from its weights, its own rotary written out, per head;
  the attention each merged token receives (mean over the image's queries, summed over its m² patches).
- ``masked_reference``: the unmodified model with the dropped image tokens' keys masked out, at the full model's
  M-RoPE positions; ``masked_decode``: one decode step after it on its full cache.
"""

from __future__ import annotations

import torch
from hf_cache import cache_kw, cache_of
from torch import Tensor


def raster_patch_coords(h: int, w: int, merge: int) -> Tensor:
    """(h·w, 2) long: (row, col) of each patch in processor order (block-major: m×m blocks adjacent, raster inside)."""
    coords = []
    for block in range((h // merge) * (w // merge)):
        bh, bw = divmod(block, w // merge)
        for inner in range(merge * merge):
            dh, dw = divmod(inner, merge)
            coords.append((bh * merge + dh, bw * merge + dw))
    return torch.tensor(coords)


def window_of(h: int, w: int, merge: int, window: int) -> Tensor:
    """(N,) the window id of each merged token (raster), windows of window×window merged tokens, row-major."""
    mh, mw = h // merge, w // merge
    across = -(-mw // window)
    rows = torch.arange(mh).repeat_interleave(mw)
    cols = torch.arange(mw).repeat(mh)
    return (rows // window) * across + cols // window


def vision_rotary(coords: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin (n, hd) of Qwen's 2-D vision rotary: a quarter of the dims per axis, halves repeated."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float64) / spatial))  # (hd/4,)
    angles = torch.cat([coords[:, :1] * inv_freq, coords[:, 1:] * inv_freq], dim=-1).double()  # (n, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (n, hd)
    return angles.cos(), angles.sin()


def received_by_hand(
    block: torch.nn.Module, hidden_raster: Tensor, h: int, w: int, merge: int, theta: float, window: int | None
) -> tuple[Tensor, Tensor]:
    """(H, N) attention each merged token receives at ``block`` and (H, N, hd) its keys before rotary (mean of its
    patches'), for one image whose block input (raster patch order, (h·w, C)) is ``hidden_raster``; ``window`` None
    for a full-attention block."""
    attn = block.attn
    x = block.norm1(hidden_raster)
    n = x.shape[0]
    heads = attn.num_heads
    q, k, _ = attn.qkv(x).reshape(n, 3, heads, -1).unbind(1)  # (n, H, hd)
    cos, sin = vision_rotary(raster_patch_coords(h, w, merge), q.shape[-1], theta)

    def rot(t: Tensor) -> Tensor:
        half = t.shape[-1] // 2
        return t * cos[:, None] + torch.cat([-t[..., half:], t[..., :half]], -1) * sin[:, None]

    scores = torch.einsum("ihd,jhd->hij", rot(q), rot(k)) * q.shape[-1] ** -0.5  # (H, n, n)
    if window is not None:
        token_window = window_of(h, w, merge, window).repeat_interleave(merge * merge)  # (n,) per patch
        scores = scores.masked_fill(token_window[:, None] != token_window[None, :], float("-inf"))
    weights = scores.softmax(-1)  # (H, n, n)
    per_patch = weights.sum(1) / n  # (H, n): mean over the image's queries
    keys = k.reshape(-1, merge * merge, heads, k.shape[-1]).mean(1).transpose(0, 1)  # (H, N, hd)
    return per_patch.reshape(heads, -1, merge * merge).sum(-1), keys  # (H, N), (H, N, hd)


def full_positions(model: torch.nn.Module, inputs: dict) -> Tensor:
    """(3, B, L): the unmodified model's M-RoPE positions for ``inputs`` (transformers' own ``get_rope_index``)."""
    positions, _ = model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    return positions


def masked_reference(model: torch.nn.Module, inputs: dict, dropped: Tensor, use_cache: bool = False):
    """The unmodified model with the keys of the ``dropped`` (B, L) bool positions masked out, every position at its
    full-sequence M-RoPE position; returns its output (logits (B, L, V), cache when asked)."""
    positions = full_positions(model, inputs)
    mask = inputs["attention_mask"] * (~dropped).long()
    return model(**{**inputs, "attention_mask": mask, "position_ids": positions}, use_cache=use_cache)


def masked_decode(model: torch.nn.Module, inputs: dict, dropped: Tensor, next_tokens: Tensor) -> Tensor:
    """Logits (B, 1, V) of one decode step of ``next_tokens`` (B, 1) after ``masked_reference``'s prefill: the new
    token attends to the masked full cache and sits at the unmodified model's next position (max + 1 per sample)."""
    positions = full_positions(model, inputs)
    prefill = masked_reference(model, inputs, dropped, use_cache=True)
    valid = inputs["attention_mask"].bool()
    next_position = torch.stack([positions[:, b][:, valid[b]].max() + 1 for b in range(positions.shape[1])])  # (B,)
    step_positions = next_position.view(1, -1, 1).expand(3, -1, 1)
    mask = torch.cat([inputs["attention_mask"] * (~dropped).long(), torch.ones_like(next_tokens)], dim=1)
    out = model(
        input_ids=next_tokens,
        attention_mask=mask,
        position_ids=step_positions,
        **cache_kw(cache_of(prefill)),
        use_cache=True,
    )
    return out.logits


def last_block_query_key(model: torch.nn.Module, inputs: dict) -> tuple[Tensor, Tensor]:
    """(P, H, hd) each, in tower order: the last tower block's queries and keys for the prompt's videos, as the
    video-pruning authors take them (FastVID, FlashVID): its fused ``qkv`` on the block's (normed) input, the model's
    own rotary on both, read by a pre-hook while ``get_video_features`` runs."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    attention = model.model.visual.blocks[-1].attn
    seen: dict = {}

    def grab(module, args, kwargs):
        seen.update(hidden=args[0] if args else kwargs["hidden_states"], **kwargs)

    handle = attention.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    handle.remove()
    hidden, heads = seen["hidden"], attention.num_heads
    q, k, _ = attention.qkv(hidden).reshape(len(hidden), 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
    return apply_rotary_pos_emb_vision(q, k, *seen["position_embeddings"])


def videos_in_raster(model: torch.nn.Module, grid: Tensor, scores: Tensor, merge: int) -> list[Tensor]:
    """Per video of ``grid`` (V, 3), (t, (h/m)·(w/m)): ``scores`` (G,) per merged token of the tower call in tower
    order, Qwen2.5-VL's window order undone (the authors' ``reverse_indices``: argsort of the window index)."""
    from transformers.vision_utils import get_vision_window_index

    visual = model.model.visual
    if hasattr(visual, "fullatt_block_indexes"):
        window_index, _ = get_vision_window_index(
            grid, visual.spatial_merge_size, visual.window_size, visual.patch_size
        )
        scores = scores[torch.argsort(window_index)]
    out, at = [], 0
    for t, h, w in grid.tolist():
        count = t * (h // merge) * (w // merge)
        out.append(scores[at : at + count].reshape(t, -1))
        at += count
    return out
