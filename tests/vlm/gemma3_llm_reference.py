"""An independent reference for dropping inside Gemma 3's LLM: the unmodified decoder layers run one by one with
masks written here from their definition (no vitrim code, no transformers mask builder), keys masked out from each
drop layer K on.

Gemma 3's masks, as its paper and ``modeling_gemma3.py`` define them: a query at column q may see key column k when
(k ≤ q, or q and k lie in the same run of image tokens: the image block is bidirectional) and k is not padding; on
a sliding-window layer also q − k < window (one-sided: the image block's later keys stay visible). Each layer type
has its own rotary table. The reference's KV cache is a plain ``DynamicCache()`` (every layer keeps every token),
so at a decode step the window is a mask on the full cache, never a truncated cache.
"""

from __future__ import annotations

import pytest
import torch
from hf_cache import cache_kw
from torch import Tensor

from tiny_vlms.gemma3 import GRID_TOKENS, IMAGE_TOKEN

transformers = pytest.importorskip("transformers")


def llm_embeddings(model, input_ids: Tensor, pixel_values: Tensor) -> Tensor:
    """(B, L, D): the LLM's input, the projector's image tokens in the image positions (reading order)."""
    with torch.no_grad():
        embeds = model.model.get_input_embeddings()(input_ids).clone()
        image = model.model.get_image_features(pixel_values).pooler_output  # (I, N, D)
        embeds[input_ids == IMAGE_TOKEN] = image.reshape(-1, image.shape[-1]).to(embeds.dtype)
    return embeds


def image_runs(input_ids: Tensor) -> Tensor:
    """(B, L) long: the number of the run of image tokens each column belongs to, -1 at text."""
    is_image = input_ids == IMAGE_TOKEN
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, starts.long().cumsum(1) - 1, -1)


def kept_columns(input_ids: Tensor, kept: list[Tensor]) -> Tensor:
    """(B, L) bool: every text column, and the image columns whose token is kept (images in reading order,
    GRID_TOKENS each)."""
    keep = input_ids != IMAGE_TOKEN
    for number, (row, col) in enumerate((input_ids == IMAGE_TOKEN).nonzero().tolist()):
        image, token = divmod(number, GRID_TOKENS)
        keep[row, col] = token in kept[image].tolist()
    return keep


def allowed(runs: Tensor, padding: Tensor, past: int, window: int | None) -> Tensor:
    """(B, q, past + q) bool: which keys each of the last q columns may see (runs, padding: (B, past + q))."""
    total = runs.shape[1]
    query = torch.arange(past, total)[None, :, None]
    key = torch.arange(total)[None, None, :]
    q_run = runs[:, past:, None]
    same_block = (q_run >= 0) & (q_run == runs[:, None, :])
    seen = ((key <= query) | same_block) & padding.bool()[:, None, :]
    return seen & (query - key < window) if window is not None else seen


def masked_gemma3(model, embeds, runs, padding, position_ids, drops: dict[int, Tensor], cache=None, past: int = 0):
    """Logits (B, q, V) of Gemma 3's LLM on ``embeds`` (B, q, D), the last q of ``past + q`` columns.

    runs: (B, past + q) image runs (-1 at text; all -1 when the caller passes no token types); padding: (B, past + q)
    the user's mask; position_ids: (B, q); drops: from each layer K in it on, no query sees a key where
    ``drops[K]`` (B, past + q) is False (cumulative). ``cache``: a plain ``DynamicCache()``, or None.
    """
    lm = model.model.language_model
    config = lm.config
    masks = {
        "full_attention": allowed(runs, padding, past, None),
        "sliding_attention": allowed(runs, padding, past, config.sliding_window),
    }
    rotary = {kind: lm.rotary_emb(embeds, position_ids, kind) for kind in masks}
    keep = torch.ones_like(padding, dtype=torch.bool)
    hidden = embeds
    for index, layer in enumerate(lm.layers):
        if index in drops:
            keep = keep & drops[index]
        kind = config.layer_types[index]
        mask = (masks[kind] & keep[:, None, :]).unsqueeze(1)  # (B, 1, q, past + q)
        if config._attn_implementation == "eager":
            mask = torch.zeros(mask.shape, dtype=embeds.dtype).masked_fill(~mask, torch.finfo(embeds.dtype).min)
        hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary[kind], position_ids=position_ids,
                       **cache_kw(cache), use_cache=cache is not None)  # fmt: skip
    return model.lm_head(lm.norm(hidden))


def greedy_reference(model, input_ids, pixel_values, padding, position_ids, drops: dict[int, Tensor], steps: int):
    """(B, steps) the tokens the masked reference picks greedily (prefill, then steps − 1 decode steps on its full
    cache, each new column kept and at the next position), and its prefill logits (B, L, V)."""
    cache = transformers.DynamicCache()
    runs = image_runs(input_ids)
    logits = masked_gemma3(model, llm_embeddings(model, input_ids, pixel_values), runs, padding, position_ids, drops,
                           cache)  # fmt: skip
    prefill, picked = logits, []
    position = position_ids[:, -1:]
    for step in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        picked.append(token)
        if step == steps - 1:
            break
        past = padding.shape[1]
        one = torch.ones_like(token)
        padding, runs, position = torch.cat([padding, one], 1), torch.cat([runs, -one], 1), position + 1
        drops = {layer: torch.cat([keep, one.bool()], 1) for layer, keep in drops.items()}
        embeds = model.model.get_input_embeddings()(token)
        logits = masked_gemma3(model, embeds, runs, padding, position, drops, cache, past)
    return torch.cat(picked, 1), prefill
