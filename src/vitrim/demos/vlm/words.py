"""The digits VLM's word-level vocabulary and its processor: questions and images into the model's inputs.

A prompt is ``<bos> <image>×64 question-words``: LLaVA's layout (the image first, then the text), with the image
placeholder expanded to one ``<image>`` token per patch as ``LlavaProcessor`` does, so that
``LlavaForConditionalGeneration`` puts the 64 projected patch features exactly there. A training sequence goes on
with the answer words and ``<eos>``. Batches are padded on the left (``<pad>``, attention mask 0), as ``generate()``
wants, and the position ids are what ``generate()`` derives from that mask (``cumsum - 1``), in training as well,
so that a prompt is seen at the same positions in training and in generation.

Text is lower-cased and split on spaces, with "?" a word of its own; a word outside the vocabulary is a
``ValueError`` that lists the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from vitrim.demos.vlm.data import CANVAS, COUNT_WORDS, DIGIT_WORDS, EMPTY_WORD, PATCH, QUADRANT_WORDS

PAD, BOS, EOS, IMAGE = "<pad>", "<bos>", "<eos>", "<image>"
QUESTION_WORDS = ("which", "digit", "digits", "is", "the", "where", "how", "many", "?")
WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            PAD,
            BOS,
            EOS,
            IMAGE,
            *QUESTION_WORDS,
            *DIGIT_WORDS,
            *COUNT_WORDS.values(),
            *sum(QUADRANT_WORDS, ()),
            EMPTY_WORD,
        ]
    )
)  # fixed order: the shipped weights' embedding rows follow it
WORD_IDS = {word: i for i, word in enumerate(WORDS)}
PAD_ID, BOS_ID, EOS_ID, IMAGE_ID = 0, 1, 2, 3
IMAGE_TOKENS = (CANVAS // PATCH) ** 2
MEAN, STD = 0.5, 0.5  # ink in [0, 1] -> [-1, 1], as vitrim's digits pipeline


def split_words(text: str) -> list[str]:
    """``"Which digit?"`` -> ``["which", "digit", "?"]`` (lower case; "?" its own word; a trailing "?" added)."""
    if not isinstance(text, str):
        raise TypeError(f"question must be a str, got {type(text).__name__}")
    words = text.lower().replace("?", " ? ").split()
    if not words:
        raise ValueError("question is empty")
    return words if words[-1] == "?" else [*words, "?"]


def encode_words(words: Sequence[str]) -> list[int]:
    ids = []
    for word in words:
        if word not in WORD_IDS or word in (PAD, BOS, EOS, IMAGE):
            known = " ".join(w for w in WORDS[4:])
            raise ValueError(f"the digits VLM does not know the word {word!r}; it knows: {known}")
        ids.append(WORD_IDS[word])
    return ids


def decode_ids(ids: Sequence[int]) -> str:
    """Generated ids -> answer text, up to the first ``<eos>`` (padding and special tokens dropped)."""
    words = []
    for i in ids:
        if i == EOS_ID:
            break
        if i > IMAGE_ID:
            words.append(WORDS[i])
    return " ".join(words)


def pixel_values(canvases: Tensor | np.ndarray) -> Tensor:
    """(B, CANVAS, CANVAS) ink in [0, 1] -> (B, 3, CANVAS, CANVAS) float32, normalised, grey repeated (CLIP is RGB)."""
    pixels = torch.as_tensor(canvases, dtype=torch.float32)
    if pixels.ndim != 3 or tuple(pixels.shape[1:]) != (CANVAS, CANVAS):
        raise ValueError(f"canvases must be (B, {CANVAS}, {CANVAS}), got {tuple(pixels.shape)}")
    return ((pixels - MEAN) / STD).unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def left_pad(sequences: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """Token id lists -> input_ids, attention_mask, position_ids, each (B, L), padded on the left."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, length - len(seq) :] = torch.tensor(seq, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        mask[row, length - len(seq) :] = 1
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # what generate() derives from the mask
    return ids, mask, positions


def prompt_ids(question: str | Sequence[str]) -> list[int]:
    """``<bos> <image>×64 question`` as ids; ``question`` is text or its words."""
    words = split_words(question) if isinstance(question, str) else list(question)
    return [BOS_ID, *([IMAGE_ID] * IMAGE_TOKENS), *encode_words(words)]


def processor(canvases: Tensor | np.ndarray, questions: Sequence[str | Sequence[str]]) -> dict[str, Tensor]:
    """What ``model.generate(**processor(canvases, questions))`` needs: input_ids, attention_mask (B, L), pixel_values.

    canvases: (B, CANVAS, CANVAS) ink in [0, 1]; questions: B texts (or word lists).
    """
    if len(questions) != len(canvases):
        raise ValueError(f"got {len(canvases)} canvases but {len(questions)} questions")
    ids, mask, _ = left_pad([prompt_ids(q) for q in questions])
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixel_values(canvases)}


def training_batch(
    canvases: Tensor | np.ndarray, questions: Sequence[Sequence[str]], answers: Sequence[Sequence[str]]
) -> dict[str, Tensor]:
    """Prompt + answer + ``<eos>`` per sample, left-padded; ``labels`` is -100 except on the answer and ``<eos>``
    (transformers shifts them: the logits at position t predict labels[t])."""
    sequences, labels = [], []
    for q, a in zip(questions, answers):
        prompt, answer = prompt_ids(q), [*encode_words(a), EOS_ID]
        sequences.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    return labelled_batch(sequences, labels, canvases)


def labelled_batch(
    sequences: list[list[int]], labels: list[list[int]], canvases: Tensor | np.ndarray
) -> dict[str, Tensor]:
    """The token ``sequences`` left-padded with their ``labels`` (each as long as its sequence; -100 where no loss)
    and the canvases' pixels: input_ids, attention_mask, position_ids, labels (B, L), pixel_values."""
    ids, mask, positions = left_pad(sequences)
    target = torch.full_like(ids, -100)
    for row, lab in enumerate(labels):
        target[row, ids.shape[1] - len(lab) :] = torch.tensor(lab, dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": positions,
        "pixel_values": pixel_values(canvases),
        "labels": target,
    }
