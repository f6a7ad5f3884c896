"""Shortening the LLM input at a pruned prefill, and the decode mask after it (positions of any leading rank).

Conventions: ``keep`` (B, L) is True where a column of the UNMODIFIED LLM input stays; padding columns (attention
mask 0) always go, and the kept columns of a sample are re-padded on the side the batch was padded on (left when
the last column is valid everywhere, which is what ``generate`` needs: its next token reads the last column).
Kept columns keep their ORIGINAL position ids, sliced on the last dimension, so ``position_ids`` may be (B, L),
(3, B, L) (M-RoPE) or (4, B, L) (``generate``'s text row + M-RoPE); new padding columns get position 1 and mask 0.
The shortened input always carries an explicit 2-D mask: gapped positions without one read as packed sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DecodeLayout:
    """The cache's layout after a shortened prefill.

    full_length: L, the unmodified prefill's length (the caller's masks keep counting from it)
    kept_mask: (B, L') long, the shortened prefill's attention mask (the cache's first L' columns)
    """

    full_length: int
    kept_mask: Tensor


def shorten_prefill(
    keep: Tensor, inputs_embeds: Tensor, attention_mask: Tensor | None, position_ids: Tensor
) -> tuple[dict[str, Tensor], DecodeLayout]:
    """The LLM's prefill kwargs with only the ``keep`` columns: inputs_embeds (B, L', D), attention_mask (B, L'),
    position_ids (..., B, L'); and the layout decoding continues from."""
    batch, length = keep.shape
    valid = torch.ones_like(keep) if attention_mask is None else attention_mask.bool()
    keep = keep & valid  # (B, L)
    counts = keep.sum(1)  # (B,)
    width = int(counts.max())
    left = attention_mask is None or bool(attention_mask[:, -1].all())
    rows, cols = keep.nonzero(as_tuple=True)  # kept columns, row-major, in order
    rank = torch.cumsum(keep.long(), 1)[rows, cols] - 1  # (K,) rank among the row's kept columns
    targets = rank + (width - counts[rows]) if left else rank  # (K,) new column
    embeds = inputs_embeds.new_zeros(batch, width, inputs_embeds.shape[-1])
    embeds[rows, targets] = inputs_embeds[rows, cols]
    mask = keep.new_zeros(batch, width, dtype=torch.long)
    mask[rows, targets] = 1
    positions = position_ids.new_ones(*position_ids.shape[:-2], batch, width)
    positions[..., rows, targets] = position_ids[..., rows, cols]
    if attention_mask is not None:
        mask = mask.to(attention_mask.dtype)
    shortened = {"inputs_embeds": embeds, "attention_mask": mask, "position_ids": positions}
    return shortened, DecodeLayout(full_length=length, kept_mask=mask)


def decode_mask(layout: DecodeLayout, attention_mask: Tensor | None, cached: int, query_length: int) -> Tensor:
    """The 2-D mask (B, cached + query_length) over the cache of a shortened prefill, from the caller's mask in the
    UNMODIFIED layout (B, L + tokens decoded so far + query_length), or None (every new column valid)."""
    kept_mask = layout.kept_mask
    decoded = cached - kept_mask.shape[1] + query_length  # columns after the prefill, this step's included
    if attention_mask is None:
        return torch.cat([kept_mask, kept_mask.new_ones(kept_mask.shape[0], decoded)], dim=1)
    if attention_mask.shape[-1] == layout.full_length + decoded:
        return torch.cat([kept_mask.to(attention_mask.dtype), attention_mask[:, layout.full_length :]], dim=1)
    if attention_mask.shape[-1] == cached + query_length:
        return attention_mask  # already in the cache's layout
    raise ValueError(
        f"attention_mask has {attention_mask.shape[-1]} columns after a pruned prefill of {layout.full_length} "
        f"tokens and {decoded} since; expected {layout.full_length + decoded} (the unpruned layout)"
    )
