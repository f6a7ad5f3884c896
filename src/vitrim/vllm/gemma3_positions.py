"""Where a trimmed Gemma 3 prompt's tokens sit for the LLM: their ORIGINAL positions, and each image's block.

vitrim.vlm runs Gemma 3 with every kept token at its unpruned position (``Gemma3Adapter.authors_positions`` is
False: its LLM's sliding-window and image-block masks count original distance), so vLLM must number the shortened
prompt as the full one: text after an image continues where it would after all N of its tokens, a kept image token
sits at its image's first position + its raster index, and decoding goes on from the unpruned length.

vLLM gives a model its own positions per request only through M-RoPE (``get_mrope_input_positions`` when a request
arrives, ``recompute_mrope_positions`` once its images are encoded, ``mrope_position_delta`` for decode), so the
trimmed class declares M-RoPE (:func:`vitrim.vllm.compat.declare_gemma3_mrope`) with three rows of its own meaning
(owned here), of which only row 0 reaches Gemma 3's one-dimensional rotary:

- row 0 and row 2: the token's original position;
- row 1: the same for text; for an image token ``-1 - b``, b the original position of its image's first token, so
  the attention can tell which tokens share an image block (:func:`blocks_of`). Decode rows are text (vLLM writes
  one value in every row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def prompt_positions(tokens: Sequence[int], image_token: int, tokens_per_image: int) -> tuple[Tensor, int]:
    """(3, L) long positions of a prompt whose images hold fewer than ``tokens_per_image`` placeholders, and the
    decode delta (unpruned length − L). An image's j-th placeholder sits at its first position + j until
    :func:`place_kept` moves it to its raster index; the text after an image continues at the first position + N."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    is_image = ids == image_token  # (L,)
    starts = is_image & ~torch.cat([torch.zeros(1, dtype=torch.bool), is_image[:-1]])  # each image's first token
    run = torch.cumsum(starts.long(), 0)  # (L,) images begun so far
    kept = torch.bincount(run[is_image], minlength=int(run.max()) + 1 if len(run) else 1)  # kept per image
    dropped = tokens_per_image - kept  # (images + 1,), [0] unused
    dropped[0] = 0
    if (dropped < 0).any():
        raise ValueError(f"vitrim: an image of this prompt holds more than {tokens_per_image} image tokens")
    ends = is_image & ~torch.cat([is_image[1:], torch.zeros(1, dtype=torch.bool)])  # each image's last token
    # text after an image's last token moves on by the tokens it dropped
    shift = torch.cumsum(torch.where(ends, dropped[run], 0), 0) - torch.where(ends, dropped[run], 0)  # (L,)
    original = torch.arange(len(ids)) + shift  # (L,)
    first = torch.zeros(len(kept), dtype=torch.long)
    first[run[starts]] = original[starts]
    row1 = torch.where(is_image, -1 - first[run], original)
    return torch.stack([original, row1, original]), int(dropped.sum())


def place_kept(embeds: Sequence[Tensor], positions: Tensor, num_computed: int) -> tuple[list[Tensor], Tensor]:
    """The embeddings of the images encoded for this step (each (k, E + 1): its kept tokens in raster order, the
    last column their raster index) without their last column, and ``positions`` (3, L) with each kept token at
    its image's first position + its raster index. The images of a step are whole (the class sets vLLM's
    ``disable_chunked_mm_input``), so their tokens are the prompt's image tokens from ``num_computed`` on, in order.
    """
    positions = positions.clone()
    image_rows = (positions[1] < 0).nonzero()[:, 0]  # (T,) every image token of the prompt
    image_rows = image_rows[image_rows >= num_computed]
    stripped, at = [], 0
    for embed in embeds:
        rows = image_rows[at : at + embed.shape[0]]
        at += embed.shape[0]
        raster = embed[:, -1].round().long().to(positions.device)  # (k,)
        first = -1 - positions[1, rows]  # (k,) the image's first original position
        positions[0, rows] = first + raster
        positions[2, rows] = first + raster
        stripped.append(embed[:, :-1])
    return stripped, positions


def blocks_of(positions: Tensor) -> tuple[Tensor, Tensor]:
    """From a step's (3, n) positions: each token's original position (n,) and image block (n,), the first original
    position of its image (−1: text)."""
    block = torch.where(positions[1] < 0, -1 - positions[1], torch.full_like(positions[1], -1))
    return positions[0], block
