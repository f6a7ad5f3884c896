"""The digits video model's word vocabulary and its processor: clips and questions into Qwen2-VL's inputs.

A prompt is ``<bos> <vision_start> <video>×64 <vision_end> question-words``, the layout Qwen2-VL's processor writes
for one video (4 temporal patches of 4×4 merged tokens), with ``mm_token_type_ids`` 2 on the video tokens so that
the model numbers them with its own M-RoPE (``get_rope_index``: temporal patch, row, column) in training and in
``generate()`` alike. ``pixel_values_videos`` holds the clip's patches in the order Qwen2-VL's image processor writes
them (:func:`video_patches`). A training sequence goes on with the answer words and ``<eos>``; batches are padded
on the left (``<pad>``, attention mask 0), as ``generate()`` wants. Text is split as the LLaVA demo's
(:func:`vitrim.demos.vlm.words.split_words`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from vitrim.demos.video.data import (
    FRAME,
    FRAME_COUNT_WORDS,
    FRAMES,
    HALF_WORDS,
    MERGE,
    PATCH,
    QUESTIONS,
    TEMPORAL,
    TEMPORAL_PATCH,
    TOKENS_PER_TEMPORAL_PATCH,
)
from vitrim.demos.vlm.data import DIGIT_WORDS
from vitrim.demos.vlm.words import MEAN, STD, left_pad, split_words

PAD, BOS, EOS, IMAGE, VIDEO, VISION_START, VISION_END = (
    "<pad>", "<bos>", "<eos>", "<image>", "<video>", "<vision_start>", "<vision_end>"
)  # fmt: skip
SPECIAL = (PAD, BOS, EOS, IMAGE, VIDEO, VISION_START, VISION_END)
WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        [*SPECIAL, *sum(QUESTIONS.values(), ()), *DIGIT_WORDS, *sum(HALF_WORDS, ()), *FRAME_COUNT_WORDS.values()]
    )
)  # fixed order: the shipped weights' embedding rows follow it
WORD_IDS = {word: i for i, word in enumerate(WORDS)}
PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, VIDEO_ID, VISION_START_ID, VISION_END_ID = range(len(SPECIAL))
VIDEO_TOKENS = TEMPORAL * TOKENS_PER_TEMPORAL_PATCH
GRID_THW = (TEMPORAL, FRAME // PATCH, FRAME // PATCH)  # video_grid_thw of every clip, in patches
CHANNELS = 3


def encode_words(words: Sequence[str]) -> list[int]:
    ids = []
    for word in words:
        if word not in WORD_IDS or word in SPECIAL:
            known = " ".join(WORDS[len(SPECIAL) :])
            raise ValueError(f"the digits video model does not know the word {word!r}; it knows: {known}")
        ids.append(WORD_IDS[word])
    return ids


def decode_ids(ids: Sequence[int]) -> str:
    """Generated ids -> answer text, up to the first ``<eos>`` (padding and special tokens dropped)."""
    words = []
    for i in ids:
        if i == EOS_ID:
            break
        if i >= len(SPECIAL):
            words.append(WORDS[i])
    return " ".join(words)


def video_patches(frames: Tensor | np.ndarray) -> Tensor:
    """(B, FRAMES, FRAME, FRAME) ink in [0, 1] -> ``pixel_values_videos`` (B·T·H·W, C·2·P·P) float32, normalised, grey
    repeated on 3 channels; rows in Qwen2-VL's order (temporal patch, merge-block row, merge-block column, row within
    the block, column within it), columns (channel, frame within the temporal patch, pixel row, pixel column)."""
    pixels = torch.as_tensor(frames, dtype=torch.float32)
    if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (FRAMES, FRAME, FRAME):
        raise ValueError(f"clips must be (B, {FRAMES}, {FRAME}, {FRAME}), got {tuple(pixels.shape)}")
    b, (t, h, w) = len(pixels), GRID_THW
    x = ((pixels - MEAN) / STD).unsqueeze(2).expand(-1, -1, CHANNELS, -1, -1)  # (B, F, C, H, W)
    x = x.reshape(b, t, TEMPORAL_PATCH, CHANNELS, h // MERGE, MERGE, PATCH, w // MERGE, MERGE, PATCH)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(b * t * h * w, CHANNELS * TEMPORAL_PATCH * PATCH * PATCH).contiguous()


def prompt_ids(question: str | Sequence[str]) -> list[int]:
    """``<bos> <vision_start> <video>×64 <vision_end> question`` as ids; ``question`` is text or its words."""
    words = split_words(question) if isinstance(question, str) else list(question)
    return [BOS_ID, VISION_START_ID, *([VIDEO_ID] * VIDEO_TOKENS), VISION_END_ID, *encode_words(words)]


def _inputs(ids: Tensor, mask: Tensor, frames: Tensor | np.ndarray) -> dict[str, Tensor]:
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": 2 * (ids == VIDEO_ID).int(),
        "pixel_values_videos": video_patches(frames),
        "video_grid_thw": torch.tensor([GRID_THW] * len(ids)),
    }


def processor(clips: Tensor | np.ndarray, questions: Sequence[str | Sequence[str]]) -> dict[str, Tensor]:
    """What ``model.generate(**processor(clips, questions))`` needs.

    clips: (B, FRAMES, FRAME, FRAME) ink in [0, 1]; questions: B texts (or word lists). Returns input_ids,
    attention_mask, mm_token_type_ids (B, L), pixel_values_videos (B·256, 96) and video_grid_thw (B, 3).
    """
    if len(questions) != len(clips):
        raise ValueError(f"got {len(clips)} clips but {len(questions)} questions")
    ids, mask, _ = left_pad([prompt_ids(q) for q in questions])
    return _inputs(ids, mask, clips)


def labelled_batch(
    sequences: list[list[int]], labels: list[list[int]], clips: Tensor | np.ndarray
) -> dict[str, Tensor]:
    """The token ``sequences`` left-padded with their ``labels`` (each as long as its sequence; -100 where no loss)
    and the clips' pixels: :func:`processor`'s inputs plus labels (B, L)."""
    ids, mask, _ = left_pad(sequences)
    target = torch.full_like(ids, -100)
    for row, lab in enumerate(labels):
        target[row, ids.shape[1] - len(lab) :] = torch.tensor(lab, dtype=torch.long)
    return {**_inputs(ids, mask, clips), "labels": target}
