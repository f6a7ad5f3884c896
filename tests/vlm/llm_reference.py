"""Independent references for the in-LLM drop tests (on tiny_vlms.llms' LLMs): prompts with spans of "image"
positions, and the full model run layer by layer with chosen keys masked out from layer K on (no vitrim code).

The masked reference is the definition of dropping with original positions: every layer sees every token, and
from layer K on no query may attend to a dropped key. Its KV cache holds every token, so a decode step is the
same masking on the full cache.
"""

from __future__ import annotations

import pytest
import torch
from hf_cache import cache_kw
from torch import Tensor
from torch.nn.functional import cosine_similarity

from tiny_vlms.llms import VOCAB

transformers = pytest.importorskip("transformers")

from vitrim.vlm.stages.spans import ImageSpans, spans_from_mask  # noqa: E402


def prompts(
    lengths: list[tuple[int, ...]], image_tokens: int, seed: int = 0, side: str = "left"
) -> tuple[Tensor, Tensor, ImageSpans]:
    """A padded batch: sample b is ``before`` text tokens, ``images`` times (``image_tokens`` image positions and one
    text token), then ``after`` text tokens, for (before, after[, images = 1]) in ``lengths``.
    Returns input_ids (B, L), attention_mask (B, L), spans."""
    generator = torch.Generator().manual_seed(seed)
    rows, images, counts = [], [], []
    for before, after, *rest in lengths:
        number = rest[0] if rest else 1
        ids = torch.randint(3, VOCAB, (before + number * (image_tokens + 1) + after,), generator=generator)
        image = torch.zeros_like(ids, dtype=torch.bool)
        for start in range(before, before + number * (image_tokens + 1), image_tokens + 1):
            image[start : start + image_tokens] = True
        rows.append(ids)
        images.append(image)
        counts += [image_tokens] * number
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    is_image = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (row, image) in enumerate(zip(rows, images, strict=True)):
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        input_ids[b, cols] = row
        attention_mask[b, cols] = 1
        is_image[b, cols] = image
    return input_ids, attention_mask, spans_from_mask(is_image, counts)


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids as generate() makes them for a left-padded batch: (B, L)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def kept_keys(spans: ImageSpans, kept: list[Tensor]) -> Tensor:
    """(B, L) bool: every non-image position, and the image positions whose raster index is kept."""
    keep = ~spans.is_image.clone()
    for image, tokens in enumerate(kept):
        keep |= (spans.image_of == image) & torch.isin(spans.token_of, tokens)
    return keep


def masked_forward(model, input_ids, attention_mask, drops: dict[int, Tensor], cache=None, past: int = 0):
    """Logits (B, q, V) of the model run layer by layer; from each layer K in ``drops`` on, no query attends to a
    key where ``drops[K]`` (B, past + q) is False. ``attention_mask`` (B, past + q) is the user's padding."""
    hidden = model.model.embed_tokens(input_ids)
    position_ids = positions(attention_mask)[:, past:]
    return model.lm_head(masked_layers(model.model, hidden, attention_mask, position_ids, drops, cache, past))


def masked_layers(
    lm, hidden, attention_mask, position_ids, drops: dict[int, Tensor], cache=None, past: int = 0, windows=None
):
    """The decoder stack ``lm`` (``.layers``, ``.norm``, ``.rotary_emb``) on ``hidden`` (B, q, D) with the masks
    of :func:`masked_forward`; returns the final-normed hidden states (B, q, D). ``windows``: per layer, a sliding
    window (a query sees keys fewer than that many columns back) or None."""
    length = hidden.shape[1]
    if position_ids is None:
        position_ids = torch.arange(past, past + length)[None]
    cos_sin = lm.rotary_emb(hidden, position_ids=position_ids)
    query = torch.arange(past, past + length)
    key = torch.arange(past + length)
    allowed = (key[None, :] <= query[:, None])[None] & attention_mask.bool()[:, None, :]  # (B, q, past+q)
    allowed = allowed.unsqueeze(1)
    for index, layer in enumerate(lm.layers):
        for start, keep in drops.items():
            if index == start:
                allowed = allowed & keep[:, None, None, :]
        mask = allowed
        if windows is not None and windows[index] is not None:
            mask = mask & (query[:, None] - key[None, :] < windows[index])
        if lm.config._attn_implementation == "eager":
            mask = torch.zeros(allowed.shape, dtype=hidden.dtype).masked_fill(~allowed, torch.finfo(hidden.dtype).min)
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin,
                       **cache_kw(cache), use_cache=cache is not None)  # fmt: skip
    return lm.norm(hidden)


def top_k_reference(scores: Tensor, k: int) -> list[int]:
    """The k largest scores, ties to the earlier index, as a sorted list (plain Python sort)."""
    values = scores.detach().tolist()
    ranked = sorted(range(len(values)), key=lambda j: (-values[j], j))
    return sorted(ranked[:k])


def dart_reference(image_norms, text_norms, image_states, text_states, keep, pivot_image, pivot_text, positions=None):
    """DART's selection in the authors' shape (pivot lists, a shrinking pool, least-similar first), with vitrim's
    documented exact count: keep − pivots split evenly, earlier-visited pivots one more. Pivots visited in sequence
    order, or, with ``positions`` = (image positions, text positions) in the sample's sequence, in the authors'
    order: the order of the Python set their code builds from those positions (image pivots, then text pivots, each
    largest norm first)."""
    image_pivots = top_k_reference(image_norms, min(pivot_image, len(image_norms), keep))
    if keep <= len(image_pivots):
        return image_pivots
    text_pivots = top_k_reference(text_norms, min(pivot_text, len(text_norms)))
    pivots = [image_states[i] for i in image_pivots] + [text_states[j] for j in text_pivots]
    if positions is not None:
        by_norm = lambda norms, chosen: sorted(chosen, key=lambda j: (-float(norms[j].detach()), j))  # noqa: E731
        keys = [("image", i) for i in by_norm(image_norms, image_pivots)] + [
            ("text", j) for j in by_norm(text_norms, text_pivots)
        ]
        position_of = {key: int(positions[0 if key[0] == "image" else 1][key[1]]) for key in keys}
        key_at = {position_of[key]: key for key in keys}
        visited = [key_at[position] for position in set(position_of[key] for key in keys)]
        pivots = [image_states[i] if kind == "image" else text_states[i] for kind, i in visited]
    remaining = keep - len(image_pivots)
    quotas = [remaining // len(pivots) + (1 if i < remaining % len(pivots) else 0) for i in range(len(pivots))]
    pool = [j for j in range(len(image_norms)) if j not in image_pivots]
    chosen = set(image_pivots)
    for pivot, quota in zip(pivots, quotas, strict=True):
        similarity = {j: float(cosine_similarity(pivot, image_states[j], dim=0)) for j in pool}
        taken = sorted(pool, key=lambda j: (similarity[j], j))[:quota]
        chosen.update(taken)
        pool = [j for j in pool if j not in taken]
    return sorted(chosen)


def dart_authors_reference(norms, states, image_start, image_length, pivot_image, pivot_text, token_topk):
    """The authors' ``get_retained_image_token`` (DART, LLaVA), step for step on one unpadded sequence: norms (L,)
    the L1 norms of layer K−1's keys, states (L, D) layer K's input through the final norm, the image at
    ``image_start`` … ``image_start + image_length − 1``; every pivot takes ``token_topk`` tokens. Returns the kept
    image tokens as raster indices (0 … image_length − 1), sorted."""
    image_norms = norms[image_start : image_start + image_length]
    text_norms = norms[image_start + image_length :]
    image_indices = (image_norms.topk(pivot_image).indices + image_start).tolist()
    query_indices = (text_norms.topk(pivot_text).indices + image_start + image_length).tolist()
    indices_set = set(image_indices + query_indices)
    valid_indices = set(range(image_start, image_start + image_length)) - set(image_indices)
    valid_indices_list = list(valid_indices)
    for item in list(indices_set):
        valid_vectors = states[valid_indices_list, :]
        cos_sim = -cosine_similarity(states[item, :], valid_vectors, dim=-1)
        top_k_indices = cos_sim.topk(token_topk).indices
        top_k_real_indices = [valid_indices_list[i] for i in top_k_indices]
        indices_set.update(top_k_real_indices)
        valid_indices.difference_update(top_k_real_indices)
        valid_indices_list = list(valid_indices)
    indices_set.difference_update(query_indices)
    return sorted(index - image_start for index in indices_set)
