"""Scoring the digits VLM: greedy answers to held-out questions, exact match per question type, prefill time.

An answer is right when the greedy generation up to ``<eos>`` is exactly the expected words. Generation is
``model.generate()`` itself, so a method of :mod:`vitrim.vlm` applied to the model is scored as a user would run it
(in-LLM methods select at the prompt's last token and decode over their pruned cache).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from vitrim.demos.vlm.data import QUESTION_TYPES, DigitsScenes, Question
from vitrim.demos.vlm.words import decode_ids, processor

MAX_ANSWER_TOKENS = 3  # two words and <eos>


@dataclass(frozen=True)
class HeldOut:
    """Held-out canvases and one question of each type about each: ``pixels[q.canvas]`` is question q's canvas.

    pixels: (C, 64, 64) float32 ink in [0, 1]; questions: 3 C questions (canvas-major, QUESTION_TYPES order).
    """

    pixels: np.ndarray
    questions: list[Question]
    digits: list[tuple[int, int, int, int]]


def held_out(canvases: int, seed: int = 0) -> HeldOut:
    """The first ``canvases`` held-out canvases (held-out digits only) and their questions."""
    scenes = DigitsScenes("test", canvases, seed=seed)
    drawn = [scenes.canvas(i) for i in range(canvases)]
    questions = [q for i, c in enumerate(drawn) for q in scenes.questions(i, c)]
    return HeldOut(np.stack([c.pixels for c in drawn]), questions, [c.digits for c in drawn])


@torch.no_grad()
def answer(
    model: nn.Module, pixels: np.ndarray, questions: Sequence[Question | str], *, batch_size: int = 96
) -> list[str]:
    """Greedy answers (text) of ``model`` to ``questions``; pixels: (N, 64, 64) with one canvas per question."""
    answers: list[str] = []
    for start in range(0, len(questions), batch_size):
        chunk = questions[start : start + batch_size]
        words = [q.words if isinstance(q, Question) else q for q in chunk]
        inputs = processor(pixels[start : start + len(chunk)], words)
        generated = model.generate(**inputs, max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False)  # type: ignore[operator]
        new = generated[:, inputs["input_ids"].shape[1] :]
        answers.extend(decode_ids(row.tolist()) for row in new)
    return answers


def accuracy_by_type(
    questions: Sequence[Any], answers: Sequence[str], kinds: Sequence[str] = QUESTION_TYPES
) -> dict[str, float]:
    """Exact-match accuracy per question type, in ``kinds`` order (the video demo passes its own); each question has
    ``kind`` and ``answer`` (its words)."""
    right: dict[str, list[bool]] = {kind: [] for kind in kinds}
    for q, a in zip(questions, answers, strict=True):
        right[q.kind].append(a == " ".join(q.answer))
    return {kind: sum(r) / len(r) for kind, r in right.items() if r}


def score(model: nn.Module, data: HeldOut, *, batch_size: int = 96) -> tuple[dict[str, float], list[str]]:
    """Accuracy per type on every held-out question, and the answers (in ``data.questions`` order)."""
    pixels = data.pixels[[q.canvas for q in data.questions]]
    answers = answer(model, pixels, data.questions, batch_size=batch_size)
    return accuracy_by_type(data.questions, answers), answers


@torch.no_grad()
def prefill_seconds(model: nn.Module, inputs: dict[str, torch.Tensor], repeats: int) -> list[float]:
    """Seconds of ``repeats`` prefills (one forward of the prompts, tower included), after one warm-up."""
    model(**inputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(**inputs)
        times.append(time.perf_counter() - start)
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)
