"""The prefill mask of a shortened sequence re-padded with filler columns, so that no row sees no key.

When the samples of a batch keep different counts, :func:`~vitrim.vlm.stages.sequence.plan_short_sequence`
re-pads the shorter ones with filler columns (attention mask 0). Given as a 2-D mask, transformers makes each
filler's row see no key at all. Under eager attention that row is NaN in float64 (its softmax runs in float32,
where the float64 mask's minimum is −inf), and the next layer carries the NaN into every real row as 0 × NaN,
although no real row attends to a filler. Under SDPA torch returns zeros for such a row, so nothing shows there.

So a prefill with fillers gets the 4-D mask transformers would build from the 2-D one, with each filler's row seeing
its own key only (:func:`with_filler_rows`, the convention the in-LLM stage and Gemma 3's masks share). A real row
sees what it saw before: keys not after it and not masked, within the LLM's sliding window counted in columns of
the shortened sequence, as transformers counts it from the 2-D mask. Fillers stay contiguous on one side of a
row, so those distances are a sample's own alone. Decode steps keep the 2-D mask on the cache's layout
(:func:`~vitrim.vlm.stages.sequence.decode_attention_mask`): their rows are real, and the fillers are no key there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vitrim.vlm.stages.sequence import ShortSequence

BUILT_HERE = ("eager", "sdpa")  # the implementations that read a 4-D mask (bool for SDPA, additive for eager)


def with_filler_rows(allowed: Tensor, real: Tensor) -> Tensor:
    """(B, H|1, S, S) bool mask with every filler (``real`` (B, S) False) no one's key and its row seeing itself."""
    diagonal = torch.eye(allowed.shape[-1], dtype=torch.bool, device=allowed.device)
    return torch.where(real[:, None, :, None], allowed & real[:, None, None, :], diagonal)


def with_own_key_where_blank(allowed: Tensor) -> Tensor:
    """(B, H|1, S, S) bool mask in which every row that sees no key (a padding row: left padding's rows come before
    any key they may see) sees its own key: under eager attention such a row is NaN in float64 (module docstring)
    and carries the NaN into every real row at the next layer. No real row sees a padding key, so nothing a real
    token computes changes."""
    diagonal = torch.eye(allowed.shape[-1], dtype=torch.bool, device=allowed.device)
    return allowed | (diagonal & ~allowed.any(dim=-1, keepdim=True))


def additive_with_own_key_where_blank(mask: Tensor) -> Tensor:
    """An additive prefill mask (B|1, 1, L, L) (0 = may attend) with :func:`with_own_key_where_blank` applied;
    ``mask`` itself when no row is blank (the model's own mask, untouched)."""
    allowed = mask > torch.finfo(mask.dtype).min / 2
    if bool(allowed.any(dim=-1).all()):
        return mask
    return torch.where(with_own_key_where_blank(allowed) & ~allowed, torch.zeros((), dtype=mask.dtype), mask)


def prefill_llm_mask(short: ShortSequence, config: Any, dtype: torch.dtype) -> Tensor | dict[str, Tensor]:
    """What the LLM of text config ``config`` gets as ``attention_mask`` for the shortened prefill ``short``.

    Without fillers, or for an attention implementation other than eager and SDPA: the 2-D mask (B, L'), from which
    transformers builds its own. Otherwise the mask (B, 1, L', L') in the form the implementation reads (bool for
    SDPA, additive in ``dtype`` for eager), or a dict of them per layer type for an LLM that mixes sliding-window
    and full layers (it takes such a dict as built).
    """
    implementation = getattr(config, "_attn_implementation", None)
    if bool(short.real.all()) or implementation not in BUILT_HERE:
        return short.attention_mask
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # one kind of layer: windowed when the config has a window (Mistral)
        return _as_implementation(_allowed(short, window), implementation, dtype)
    kinds = {"full_attention": None, "sliding_attention": window}
    masks = {kind: _as_implementation(_allowed(short, kinds[kind]), implementation, dtype) for kind in set(layer_types)}
    return masks if len(masks) > 1 else next(iter(masks.values()))


def _allowed(short: ShortSequence, window: int | None) -> Tensor:
    """(B, 1, L', L') bool: causal on the shortened columns, keys the 2-D mask keeps, within ``window``."""
    index = torch.arange(short.columns.shape[1], device=short.columns.device)
    distance = index[:, None] - index[None, :]  # (L', L') query − key
    causal = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
    allowed = causal[None, None] & short.attention_mask.bool()[:, None, None, :]
    return with_filler_rows(allowed, short.real)


def _as_implementation(allowed: Tensor, implementation: str, dtype: torch.dtype) -> Tensor:
    return allowed if implementation == "sdpa" else as_additive(allowed, dtype)


def as_additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = may attend) as the additive float mask eager attention adds to its logits: 0 where
    allowed, the dtype's most negative number elsewhere (not −inf, which would make a masked row's softmax NaN)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
