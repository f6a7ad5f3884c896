"""Scoring the digits video model: greedy answers to held-out questions, exact match per question type.

An answer is right when the greedy generation up to ``<eos>`` is exactly the expected words; generation is
``model.generate()`` itself, so a method of :mod:`vitrim.vlm` applied to the model is scored as a user would run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from vitrim.demos.video.data import QUESTION_TYPES, Clip, DigitClips, Question
from vitrim.demos.video.words import decode_ids, processor
from vitrim.demos.vlm.evaluate import accuracy_by_type

MAX_ANSWER_TOKENS = 3  # two words and <eos>


@dataclass(frozen=True)
class HeldOut:
    """Held-out clips and one question of each type about each: ``frames[q.clip]`` is question q's clip.

    frames: (C, 8, 32, 32) float32 ink in [0, 1]; questions: 3 C questions (clip-major, QUESTION_TYPES order).
    """

    frames: np.ndarray
    questions: list[Question]
    clips: list[Clip]

    def first(self, clips: int) -> HeldOut:
        """The first ``clips`` clips and their questions (the same as ``held_out(clips)``)."""
        return HeldOut(self.frames[:clips], [q for q in self.questions if q.clip < clips], self.clips[:clips])


def held_out(clips: int, seed: int = 0) -> HeldOut:
    """The first ``clips`` held-out clips (held-out glyphs only) and their questions."""
    source = DigitClips("test", clips, seed=seed)
    drawn = [source.clip(i) for i in range(clips)]
    questions = [q for i, c in enumerate(drawn) for q in source.questions(i, c)]
    return HeldOut(np.stack([c.frames for c in drawn]), questions, drawn)


@torch.no_grad()
def answer(
    model: nn.Module, frames: np.ndarray, questions: Sequence[Question | str], *, batch_size: int = 100
) -> list[str]:
    """Greedy answers (text) of ``model`` to ``questions``; frames: (N, 8, 32, 32), one clip per question."""
    answers: list[str] = []
    for start in range(0, len(questions), batch_size):
        chunk = questions[start : start + batch_size]
        words = [q.words if isinstance(q, Question) else q for q in chunk]
        inputs = processor(frames[start : start + len(chunk)], words)
        generated = model.generate(**inputs, max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False)  # type: ignore[operator]
        answers.extend(decode_ids(row.tolist()) for row in generated[:, inputs["input_ids"].shape[1] :])
    return answers


def score(model: nn.Module, data: HeldOut) -> tuple[dict[str, float], list[str]]:
    """Accuracy per type on every held-out question, and the answers (in ``data.questions`` order)."""
    answers = answer(model, data.frames[[q.clip for q in data.questions]], data.questions)
    return accuracy_by_type(data.questions, answers, QUESTION_TYPES), answers
