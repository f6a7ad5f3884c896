"""The slots the decoder layers from a drop layer K on run on, and each such layer's attention mask on them.

Conventions (owned here):
- A stage's slots are (B, S): ``columns`` maps each slot to its column in the prefill sequence as the UNMODIFIED
  model has it (decode columns appended after it), ``valid`` is False at filler slots that re-pad a batch whose
  samples kept different counts. Fillers come FIRST in each row, then the sample's kept slots in column order, so
  a sample's last slots are its latest tokens (what a sliding-window KV cache keeps).
- Masks here are bool, True = may attend; :func:`as_implementation` turns them into what the attention
  implementation reads (bool for SDPA, additive float for eager). A filler is never a key of another slot and, at
  the prefill, its row sees its own key only: a row that sees no key is NaN under eager attention (its softmax runs
  in float32, where a float64 mask's minimum is −inf), and the next layer would carry that NaN into every real row
  as 0 × NaN, although no real row attends to a filler.
- Distances are in ORIGINAL columns: a sliding-window layer sees a key when ``query column − key column < window``
  (transformers' one-sided window; an image block's later keys come from the model's own mask), so the window is
  the unmodified model's, never a count of kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.evidence.columns import expand_batch, gather_columns
from vitrim.vlm.stages.filler_masks import as_additive, with_filler_rows, with_own_key_where_blank

# the one refusal of a static or compiled cache, on every family (each layer's cache here has its own length)
DYNAMIC_CACHE_ONLY = (
    "vitrim.vlm's in-LLM drop needs generate's default dynamic cache: each decoder layer's cache holds only the "
    "tokens it kept; a static or compiled cache (cache_implementation='static', masks prepared for one) is not "
    "supported"
)


@dataclass
class Slots:
    """The slots the layers of one stage run on: columns (B, S), valid (B, S) (see the module's conventions)."""

    columns: Tensor
    valid: Tensor
    differs: bool  # False while no stage up to this one dropped anything (its layers then run untouched)
    # this pass's fixed-up layer arguments, per kind of layer (its mask, rotary table and window: Gemma 3 has two)
    kwargs: dict[tuple[int, int, int | None], dict[str, Any]] = field(default_factory=dict)


def sliding_window(layer: nn.Module) -> int | None:
    """The sliding window of a decoder layer's attention (keys fewer than ``window`` columns back), or None."""
    window = getattr(getattr(layer, "self_attn", None), "sliding_window", None)
    return int(window) if isinstance(window, int) and not isinstance(window, bool) else None


def prefill_mask(slots: Slots, full: Tensor | None, window: int | None, length: int) -> Tensor:
    """(B, 1, S, S) bool: a prefill layer's own mask ``full`` (B|1, 1, L, L) over the ``length`` = L columns —
    padding, causality, a sliding window, an image block, whatever the model built — read at the slots' rows and
    key columns, restricted to valid keys and rows; a filler's row sees itself only (module conventions). ``full``
    None (SDPA's own causal mask): causal on the original columns, within ``window``. ``ValueError`` for a mask of
    another size (built for a static or compiled cache)."""
    if full is None:
        distance = slots.columns[:, :, None] - slots.columns[:, None, :]  # (B, S, S) query − key column
        allowed = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
        allowed = allowed.unsqueeze(1)
    else:
        if full.ndim != 4 or tuple(full.shape[-2:]) != (length, length):
            raise ValueError(f"{DYNAMIC_CACHE_ONLY} (a prefill mask of shape {tuple(full.shape)}, {length} tokens)")
        rows = gather_columns(full, slots.columns, 2, 0)  # (B, 1, S, L)
        allowed = gather_columns(rows, slots.columns, 3, 0)  # (B, 1, S, S)
        if allowed.dtype != torch.bool:
            allowed = allowed == 0  # an additive float mask: 0 = may attend
    return with_own_key_where_blank(with_filler_rows(allowed, slots.valid))  # left padding's rows: their own key


def decode_mask(slots: Slots, query_columns: Tensor, kv_length: int, real: Tensor, window: int | None) -> Tensor:
    """(B, 1, q, kv) bool: a decode step's mask over the keys a layer's cache returns, its last ``kv_length`` slots
    (all of them; a sliding-window cache: its last ``window − 1`` and the q new ones). A key is seen when it is
    valid, not padding (``real``: (B|1, total columns) bool), not after the query (``query_columns``: (q,)) and,
    on a sliding layer, fewer than ``window`` columns before it."""
    batch = slots.columns.shape[0]
    key_columns = slots.columns[:, -kv_length:]  # (B, kv)
    distance = query_columns[None, :, None] - key_columns[:, None, :]  # (B, q, kv)
    seen = slots.valid[:, -kv_length:] & expand_batch(real, batch, 0).gather(1, key_columns)  # (B, kv)
    allowed = (distance >= 0) & seen[:, None, :]
    if window is not None:
        allowed = allowed & (distance < window)
    return allowed.unsqueeze(1)


def as_implementation(allowed: Tensor, like: Tensor | None, eager: bool, dtype: torch.dtype) -> Tensor:
    """``allowed`` (bool) as the attention implementation reads it: bool (SDPA), or additive float for eager, in
    the dtype of the model's own mask ``like`` when it is one, else ``dtype``."""
    if not eager:
        return allowed
    return as_additive(allowed, like.dtype if like is not None and like.is_floating_point() else dtype)
