"""Where the image tokens sit in the LLM's input: :class:`ImageSpans`, built once per prefill by the family adapter.

Conventions (owned here): positions are columns of the LLM input as the UNMODIFIED model builds it, (B, L), padding
included; images are numbered 0 … I−1 over the whole batch in reading order (sample 0's images first, each
sample's from left to right), which is the order the processor stacks ``pixel_values`` and the order of
``last_selection``'s list; ``token_of`` is the raster index of the image token within its image (the index space of
``vitrim.vlm.method.base``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

Item = TypeVar("Item")  # what a family records per encoded image or video (its selection)


@dataclass(frozen=True)
class ImageSpans:
    """Which positions of the LLM input hold image tokens, of which image, and which token of it.

    is_image: (B, L) bool  positions of the LLM input that hold image tokens
    image_of: (B, L) long  which image (0..num_images-1 over the whole batch) a position shows, -1 else
    token_of: (B, L) long  the raster index of that image token in the UNMODIFIED model's tokens, -1 else
    real: (B, L) bool | None  the columns that are neither padding nor filler, given by a stage that shortened the
                           input (its LLM mask is then 4-D, where the padding of a row cannot be read whatever side
                           it is on); None: a stage after reads it from the caller's 2-D mask
    """

    is_image: Tensor
    image_of: Tensor
    token_of: Tensor
    real: Tensor | None = None

    @property
    def num_images(self) -> int:
        return int(self.image_of.max()) + 1 if self.image_of.numel() else 0


def spans_from_mask(is_image: Tensor, tokens_per_image: Sequence[int]) -> ImageSpans:
    """ImageSpans from the image-token mask (B, L) and each image's token count (I,), images in reading order.

    The i-th run of ``tokens_per_image[i]`` image positions (in reading order) is image i; adjacent images are told
    apart by the counts, not by gaps. ``ValueError`` when the mask's image positions and the counts disagree.
    """
    counts = torch.as_tensor(list(tokens_per_image), dtype=torch.long, device=is_image.device)  # (I,)
    flat = is_image.reshape(-1)  # (B·L,) reading order
    total = int(flat.sum())
    if total != int(counts.sum()):
        raise ValueError(
            f"the input holds {total} image tokens but the images give {int(counts.sum())} "
            f"({', '.join(map(str, counts.tolist()))} per image)"
        )
    rank = torch.cumsum(flat.long(), 0) - 1  # (B·L,) index of each image position among all image positions
    starts = torch.cumsum(counts, 0) - counts  # (I,) first rank of each image
    image_of_rank = torch.repeat_interleave(torch.arange(len(counts), device=is_image.device), counts)  # (total,)
    image_of = torch.full_like(rank, -1)
    token_of = torch.full_like(rank, -1)
    image_of[flat] = image_of_rank
    token_of[flat] = rank[flat] - starts[image_of_rank]
    shape = is_image.shape
    return ImageSpans(is_image.clone(), image_of.view(shape), token_of.view(shape))


def media_in_reading_order(
    input_ids: Tensor, media: Tensor, records: dict[int, tuple[str, list[Item], list[int]]]
) -> tuple[list[Item], list[int]]:
    """A batch's images and videos in reading order, from what each modality's encoder run recorded.

    input_ids, media: (B, L), ``media`` the positions of every image's and video's tokens; records: per placeholder
    token id, (the modality's name, its encoded items' records and LLM token counts, in encode order). Returns the
    records and counts in the batch's reading order. Rows ``generate()`` repeated for beams (the batch holds a whole
    multiple of the encoded tokens) are walked once per prompt (the pre-LLM stage expands them again);
    ``ValueError`` when the prompt holds more items of a modality than were encoded.
    """
    given = sum(sum(counts) for _, _, counts in records.values())
    total = int(media.sum())
    repeat = total // given if given and total % given == 0 and total > given else 1
    taken = dict.fromkeys(records, 0)
    ordered: list[Item] = []
    counts: list[int] = []
    for row in range(0, input_ids.shape[0], repeat):
        columns = media[row].nonzero()[:, 0].tolist()
        at = 0
        while at < len(columns):
            token = int(input_ids[row, columns[at]])
            name, items, sizes = records[token]
            if taken[token] >= len(sizes):
                raise ValueError(f"the prompt holds more {name}s than the {len(sizes)} encoded")
            ordered.append(items[taken[token]])
            counts.append(sizes[taken[token]])
            at += sizes[taken[token]]
            taken[token] += 1
    return ordered, counts


def repeated_images(counts: list[int], row_tokens: list[int]) -> list[int]:
    """Per image of the batch's rows (reading order), the encoded image it shows.

    ``counts``: LLM tokens of each encoded image; ``row_tokens``: image tokens in each row. ``generate()`` encodes a
    prompt's images once and then repeats the prompt's row e times (beam search, ``num_return_sequences``): each
    prompt's images are then repeated e times in a row. Anything else is the images as encoded (a mismatch is
    reported by :func:`spans_from_mask`).
    """
    total, given = sum(row_tokens), sum(counts)
    identity = list(range(len(counts)))
    if total == given or given == 0 or total % given or len(row_tokens) % (total // given):
        return identity
    repeat = total // given
    order: list[int] = []
    image = 0
    for row in range(0, len(row_tokens), repeat):
        if any(row_tokens[row + copy] != row_tokens[row] for copy in range(repeat)):
            return identity
        mine: list[int] = []
        while sum(counts[i] for i in mine) < row_tokens[row] and image < len(counts):
            mine.append(image)
            image += 1
        order += mine * repeat
    return order


def media_spans(input_ids: Tensor, counts: dict[int, list[int]]) -> ImageSpans:
    """The spans of every image and video of ``input_ids`` (B, L), numbered together in reading order.

    ``counts``: per placeholder token id (image, video), the LLM tokens of each encoded item of that modality in
    encode order; each modality's items may be one per prompt with the prompt's row repeated (``generate()``'s beams,
    :func:`repeated_images`) or one per row. A family whose videos are visual tokens to the in-LLM stage hands it
    these spans, its images and videos interleaved as the prompt holds them.
    """
    per_row: dict[int, list[int]] = {}
    for token, sizes in counts.items():
        order = repeated_images(sizes, (input_ids == token).sum(1).tolist())
        per_row[token] = [sizes[i] for i in order]
    ids = torch.as_tensor(list(counts), device=input_ids.device)
    media = torch.isin(input_ids, ids)  # (B, L)
    taken = dict.fromkeys(counts, 0)
    ordered: list[int] = []
    for row in range(input_ids.shape[0]):
        columns = media[row].nonzero()[:, 0].tolist()
        at = 0
        while at < len(columns):
            token = int(input_ids[row, columns[at]])
            if taken[token] >= len(per_row[token]):
                break  # more placeholders than items: spans_from_mask names the mismatch
            ordered.append(per_row[token][taken[token]])
            at += ordered[-1]
            taken[token] += 1
    return spans_from_mask(media, ordered)
