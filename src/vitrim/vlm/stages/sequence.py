"""Shortening the LLM's input at prefill, and the decode fix-ups ``generate()`` needs afterwards (shared plumbing).

How the pre-LLM stage (:mod:`vitrim.vlm.stages.pre_llm`) uses it, for every family:

1. At prefill the stage knows, per sample, which columns of the UNMODIFIED LLM input stay: every text and padding
   column, and the kept image tokens (``keep_columns``, (B, L) bool, from :class:`~vitrim.vlm.stages.spans.ImageSpans`
   and the method's selection: :func:`columns_to_keep`).
2. :func:`plan_short_sequence` turns them into a :class:`ShortSequence`: per sample, the kept columns in their
   order, re-padded to the batch's longest on the side the input was padded (right when any sample's last column is
   masked, else left), filler columns masked out.
3. The stage gathers every per-column input with :func:`read_short` — the embeddings, the ORIGINAL position
   ids (LLaVA: (B, L); Qwen's M-RoPE: (3, B, L) with ``batch_dim=1``), anything else of length L — and passes
   ``short.attention_mask`` (always an explicit mask: transformers reads gapped position ids without a mask
   and without a cache as packed sequences; 4-D when there are fillers, :mod:`vitrim.vlm.stages.filler_masks`).
4. It keeps a :class:`DecodeState` and, at each later step on the same cache, calls :func:`decode_attention_mask`
   (the prefill's short mask + the new columns of the caller's full-length mask) and, when the caller passed no
   positions, :func:`decode_position_ids` (what the unmodified LLM would have used: full length + steps so far).
   ``generate()`` passes full-length masks and positions computed from them; both are right after these fix-ups.

Conventions (owned here), per the method's option ``positions``:
- ``"original"``: kept tokens keep their ORIGINAL position ids, so dropping tokens is exactly masking those keys in
  the full model; a merged token sits in the slot of its representative (the kept index its group is named by, e.g.
  VisionZip's contextual target token) and takes that slot's position id.
- ``"authors"`` (on a family with 1-D positions, see ``FamilyAdapter.authors_positions``): the sequence the authors'
  LLaVA code builds. Every column's position is its original one minus the image columns dropped before it in its
  sample (:func:`dropped_before`): the sequence numbered as if the dropped tokens had never been there (0 … n−1
  under ``generate()``'s positions, which count the real columns), and decode steps continue from it
  (``DecodeState.shift``). Within an image, the tokens enter in the order the method's authors hand them on
  (:meth:`ImageSelection.llm_slots`: VisionZip's [CLS], dominant, then contextual tokens) and take that image's
  consecutive positions in that order (:func:`reorder_images`).
- Filler columns (re-padding) have attention mask 0, zero embeddings and position id 0; they never change a real
  column's output (a masked key gets exactly zero weight).
- When every image keeps all its tokens, the stage leaves the LLM's input untouched (bit for bit the unmodified
  model), so none of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vitrim.vlm.evidence.columns import gather_columns
from vitrim.vlm.method.base import ImageSelection
from vitrim.vlm.stages.spans import ImageSpans


def columns_to_keep(spans: ImageSpans, selections: list[ImageSelection], num_tokens: int) -> Tensor:
    """(B, L) bool: text and padding columns, and the image columns whose token the selection keeps.

    ``selections``: one per image of ``spans`` (reading order); ``num_tokens``: the most tokens an image has.
    """
    kept_table = torch.zeros(len(selections), num_tokens, dtype=torch.bool, device=spans.is_image.device)  # (I, N)
    for image, selection in enumerate(selections):
        kept_table[image, selection.slots().to(kept_table.device)] = True  # the [CLS] carrier too
    kept_image = kept_table[spans.image_of.clamp(min=0), spans.token_of.clamp(min=0)]  # (B, L)
    return ~spans.is_image | (spans.is_image & kept_image)


def dropped_before(keep_columns: Tensor) -> Tensor:
    """(B, L) long: per column, the columns of its sample dropped before it (``keep_columns`` (B, L) bool)."""
    dropped = (~keep_columns).long()
    return torch.cumsum(dropped, 1) - dropped


def authors_order_offsets(spans: ImageSpans, selections: list[ImageSelection], num_tokens: int) -> Tensor:
    """(B, L) long: per kept image column, how far its token moves within its image's kept columns to enter the LLM
    in the authors' order (:meth:`ImageSelection.llm_slots`); 0 at every other column.

    ``selections``: one per image of ``spans`` (reading order); ``num_tokens``: the most tokens an image has.
    """
    device = spans.is_image.device
    offset_table = torch.zeros(len(selections), num_tokens, dtype=torch.long, device=device)  # (I, N)
    for image, selection in enumerate(selections):
        slots = selection.slots().to(device)  # raster order: where each sits among the image's kept columns
        ordered = selection.llm_slots().to(device)  # the authors' order
        rank = torch.empty(num_tokens, dtype=torch.long, device=device)
        rank[ordered] = torch.arange(len(ordered), device=device)
        offset_table[image, slots] = rank[slots] - torch.arange(len(slots), device=device)
    offsets = offset_table[spans.image_of.clamp(min=0), spans.token_of.clamp(min=0)]  # (B, L)
    return torch.where(spans.is_image, offsets, torch.zeros_like(offsets))


def reorder_images(short: ShortSequence, offsets: Tensor) -> ShortSequence:
    """``short`` with each image's kept columns permuted into the authors' order (``offsets`` (B, L) from
    :func:`authors_order_offsets`); text, padding and fillers stay where they are."""
    base = torch.arange(short.columns.shape[1], device=short.columns.device)[None]  # (1, L')
    moved = torch.where(short.real, offsets.gather(1, short.columns), torch.zeros_like(short.columns))
    order = torch.argsort(base + moved, dim=1, stable=True)  # (B, L') the column that lands at each new column
    return ShortSequence(
        columns=short.columns.gather(1, order),
        real=short.real.gather(1, order),
        attention_mask=short.attention_mask.gather(1, order),
        full_length=short.full_length,
    )


@dataclass(frozen=True)
class ShortSequence:
    """The LLM input after shortening.

    columns: (B, L') long         the original column each new column holds (0 at filler columns)
    real: (B, L') bool            False at filler columns added to re-pad the batch
    attention_mask: (B, L') long  the original mask at real columns, 0 at fillers
    full_length: int              L, the unmodified input's length
    """

    columns: Tensor
    real: Tensor
    attention_mask: Tensor
    full_length: int


def plan_short_sequence(keep_columns: Tensor, attention_mask: Tensor | None) -> ShortSequence:
    """Per sample, the kept columns in order, re-padded to the longest (B, L') on the input's padding side.

    keep_columns: (B, L) bool; attention_mask: (B, L) 0/1 or None (no padding).
    """
    batch, length = keep_columns.shape
    device = keep_columns.device
    if attention_mask is None:
        attention_mask = torch.ones(batch, length, dtype=torch.long, device=device)
    if attention_mask.dim() != 2 or attention_mask.shape != keep_columns.shape:
        raise ValueError(
            f"vitrim.vlm needs a 2-D attention_mask (batch, length) = {tuple(keep_columns.shape)}; "
            f"got shape {tuple(attention_mask.shape)}"
        )
    counts = keep_columns.sum(1)  # (B,)
    short_length = int(counts.max())
    pad_right = bool((attention_mask[:, -1] == 0).any())
    slot = torch.cumsum(keep_columns.long(), 1) - 1  # (B, L) new column of each kept column, left-aligned
    if not pad_right:
        slot = slot + (short_length - counts)[:, None]  # right-aligned: fillers go on the left, like the padding
    rows = torch.arange(batch, device=device)[:, None].expand(batch, length)
    cols = torch.arange(length, device=device)[None].expand(batch, length)
    columns = torch.zeros(batch, short_length, dtype=torch.long, device=device)
    real = torch.zeros(batch, short_length, dtype=torch.bool, device=device)
    columns[rows[keep_columns], slot[keep_columns]] = cols[keep_columns]
    real[rows[keep_columns], slot[keep_columns]] = True
    mask = torch.where(real, attention_mask.gather(1, columns), torch.zeros_like(columns))
    return ShortSequence(columns=columns, real=real, attention_mask=mask.to(attention_mask.dtype), full_length=length)


def read_short(short: ShortSequence, values: Tensor, batch_dim: int = 0) -> Tensor:
    """``values`` (…, B, L, …) with B at ``batch_dim`` and L right after it -> (…, B, L', …), fillers zero.

    A leading batch of 1 that broadcasts (position ids (1, L)) is expanded to the batch first.
    """
    gathered = gather_columns(values, short.columns, batch_dim + 1, batch_dim)
    real = short.real.view([*([1] * batch_dim), *short.real.shape, *([1] * (values.dim() - batch_dim - 2))])
    return torch.where(real, gathered, torch.zeros_like(gathered))


@dataclass(frozen=True)
class DecodeState:
    """What the decode steps after a shortened prefill need: the prefill's short mask (B, L'), the full length, and
    under the authors' positions each sample's dropped columns ``shift`` (B,) long, taken off every later position
    (None: original positions)."""

    prefill_mask: Tensor
    full_length: int
    shift: Tensor | None = None

    @property
    def short_length(self) -> int:
        return int(self.prefill_mask.shape[1])


def decode_attention_mask(state: DecodeState, attention_mask: Tensor | None, past_length: int, new: int) -> Tensor:
    """(B, past + new): the prefill's short mask, then the mask of every column after the prefill.

    ``attention_mask``: the caller's full-length mask (B, full + steps so far + new), or None (no padding after the
    prompt); ``past_length``: the cache's length (short prefill + steps so far); ``new``: columns in this step.
    """
    after_prefill = past_length - state.short_length + new
    mask = state.prefill_mask
    if attention_mask is None:
        tail = torch.ones(mask.shape[0], after_prefill, dtype=mask.dtype, device=mask.device)
    else:
        expected = state.full_length + after_prefill
        if attention_mask.dim() != 2 or attention_mask.shape[1] != expected:
            raise ValueError(
                f"after a shortened prefill vitrim.vlm expects the full-length 2-D attention_mask of "
                f"{expected} columns; got shape {tuple(attention_mask.shape)}"
            )
        tail = attention_mask[:, -after_prefill:].to(mask.dtype)
    return torch.cat([mask, tail], 1)


def decode_position_ids(state: DecodeState, past_length: int, new: int, device: torch.device) -> Tensor:
    """(1, new) (original positions) or (B, new) (authors' positions): the positions the unmodified LLM would give
    these columns (its cache would hold full + steps), less each sample's dropped columns under the authors'."""
    offset = state.full_length - state.short_length
    positions = (torch.arange(new, device=device) + past_length + offset)[None]
    return positions if state.shift is None else positions - state.shift.to(device)[:, None]
