"""Clips of one moving handwritten digit, and the questions the digits video model answers about them.

A clip is ``FRAMES`` frames of ``FRAME``×``FRAME`` pixels, in pairs: Qwen2-VL's tower reads two frames as one
**temporal patch** (``temporal_patch_size`` 2), and the digit shows on whole temporal patches, the two frames of a
pair being the same picture. The clip's one digit (a glyph of the bundled UCI digits, 8×8 scaled to 16×16) appears
at temporal patch ``start`` and stays for ``length`` temporal patches, moving to another of the 3×3 places on an
8-pixel grid at every temporal patch (8 pixels are one merged token: 4-pixel patches, 2×2 merged), so it covers
2×2 of a temporal patch's 4×4 = 16 merged tokens wherever it is; every other frame is blank. ``(start, length)`` is
drawn uniformly from the 10 pairs that fit in ``TEMPORAL`` = 4 temporal patches.

Questions (``QUESTION_TYPES``), every answer one or two words:

* ``which``: "which digit appears ?" -> "seven";
* ``when``: "when does it appear ?" -> "first half" (``start`` in the first two temporal patches, frames 1-4) or
  "second half" (frames 5-8): needs the order of the frames;
* ``count``: "how many frames show it ?" -> "two", "four", "six" or "eight" (2·``length``): needs every frame.

The glyphs come from the LLaVA demo's split of the bundled set (:class:`vitrim.demos.vlm.data.DigitsScenes`, 20 %
held out): training clips use training glyphs only (distorted by :func:`~vitrim.demos.vlm.data.distort` with
``augment``), held-out clips held-out glyphs only. Clip ``i`` of a split is a pure function of
``(seed, split, stream, epoch, i)`` (held-out clips ignore the epoch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vitrim.demos.vlm.data import DIGIT, DIGIT_WORDS, DigitsScenes, distort

FRAME = 32  # pixels
PATCH = 4  # the tower's patch: 8×8 patches per frame
MERGE = 2  # 2×2 patches merged into one LLM token: 4×4 = 16 tokens per temporal patch
TEMPORAL_PATCH = 2  # frames per temporal patch
TEMPORAL = 4  # temporal patches per clip
FRAMES = TEMPORAL * TEMPORAL_PATCH
CELL = PATCH * MERGE  # 8 pixels: one merged token
PLACES = (FRAME - DIGIT) // CELL + 1  # 3 places per axis
GRID = FRAME // CELL  # 4 merged tokens per axis
TOKENS_PER_TEMPORAL_PATCH = GRID * GRID
BACKGROUND = 10  # the token label of background (Clip.token_digits)
SPANS = tuple((start, length) for start in range(TEMPORAL) for length in range(1, TEMPORAL - start + 1))

QUESTION_TYPES = ("which", "when", "count")
HALF_WORDS = (("first", "half"), ("second", "half"))
FRAME_COUNT_WORDS = {2: "two", 4: "four", 6: "six", 8: "eight"}
QUESTIONS = {
    "which": ("which", "digit", "appears", "?"),
    "when": ("when", "does", "it", "appear", "?"),
    "count": ("how", "many", "frames", "show", "it", "?"),
}


@dataclass(frozen=True)
class Clip:
    """One clip: its frames and what is in them.

    frames: (FRAMES, FRAME, FRAME) float32 ink in [0, 1] (0 background).
    digit: the digit's value; start, length: the temporal patches it shows on (``start`` … ``start + length - 1``).
    places: per temporal patch, the (row, column) of the digit's top-left merged token, or None where it is absent.
    token_digits: (TEMPORAL · 16,) int64, per merged token (temporal patch, row, column order) the digit's value where
        its 2×2 box covers the token, else BACKGROUND.
    """

    frames: np.ndarray
    digit: int
    start: int
    length: int
    places: tuple[tuple[int, int] | None, ...]
    token_digits: np.ndarray

    @property
    def shown_frames(self) -> int:
        return TEMPORAL_PATCH * self.length


@dataclass(frozen=True)
class Question:
    """A question about clip ``clip`` of its split: its type (one of QUESTION_TYPES), words and answer words."""

    clip: int
    kind: str
    words: tuple[str, ...]
    answer: tuple[str, ...]


def answer_of(kind: str, clip: Clip) -> tuple[str, ...]:
    """The answer words to a question of type ``kind`` about ``clip`` (module doc)."""
    if kind == "which":
        return (DIGIT_WORDS[clip.digit],)
    if kind == "when":
        return HALF_WORDS[int(clip.start >= TEMPORAL // 2)]
    if kind == "count":
        return (FRAME_COUNT_WORDS[clip.shown_frames],)
    raise ValueError(f"question type must be one of {QUESTION_TYPES}, got {kind!r}")


class DigitClips:
    """One split's clips: ``clips.clip(i)`` and its questions (``clips.questions(i)``).

    Args:
        split: ``"train"`` or ``"test"`` (which glyphs of the bundled set may appear: the LLaVA demo's split).
        size: clips in the split (held-out: a fixed set; training: redrawn each epoch, see ``set_epoch``).
        seed: fixes the glyphs' split and every clip.
        stream: another set of training clips from the same split (stage 1 of the recipe draws stream 1).
        augment: distort every training glyph (:func:`~vitrim.demos.vlm.data.distort`), anew at each temporal patch.
    """

    def __init__(self, split: str, size: int, *, seed: int = 0, stream: int = 0, augment: bool = False) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        if not isinstance(stream, int) or stream < 0 or (stream and split != "train"):
            raise ValueError(f"stream must be an int >= 0, and 0 for the held-out split; got {stream!r} ({split})")
        if augment and split != "train":
            raise ValueError(f"augment distorts training clips only, got augment=True for split {split!r}")
        self.glyphs = DigitsScenes(split, 1, seed=seed)  # the glyphs of the split (its own canvases are not used)
        self.split, self.size, self.seed, self.stream, self.augment, self.epoch = split, size, seed, stream, augment, 0

    @property
    def indices(self) -> np.ndarray:
        """The bundled set's indices of the glyphs this split may show."""
        return self.glyphs.indices

    def set_epoch(self, epoch: int) -> None:
        """Draw another set of training clips (held-out clips never change)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.size

    def _rng(self, index: int, salt: int) -> np.random.Generator:
        if self.split == "train":
            return np.random.default_rng([self.seed, salt, self.stream, self.epoch, index])
        return np.random.default_rng([self.seed, salt + 1, index])

    def clip(self, index: int) -> Clip:
        if not 0 <= index < self.size:
            raise IndexError(f"clip {index} out of range for {self.size} clips")
        rng = self._rng(index, 0xC11)
        warp = self._rng(index, 0xA07) if self.augment else None  # its own stream: a clip is the same without it
        digit = int(rng.integers(10))
        start, length = SPANS[int(rng.integers(len(SPANS)))]
        glyph = self.glyphs.glyphs[self.glyphs.glyph_of(digit, rng)]
        frames = np.zeros((FRAMES, FRAME, FRAME), dtype=np.float32)
        tokens = np.full((TEMPORAL, GRID, GRID), BACKGROUND, dtype=np.int64)
        places: list[tuple[int, int] | None] = [None] * TEMPORAL
        previous = -1
        for t in range(start, start + length):
            place = int(rng.integers(PLACES * PLACES - (previous >= 0)))
            place += int(previous >= 0 and place >= previous)  # a different place at every temporal patch: it moves
            previous = place
            row, col = divmod(place, PLACES)
            shown = glyph if warp is None else distort(glyph, warp)
            y, x = row * CELL, col * CELL
            frames[t * TEMPORAL_PATCH : (t + 1) * TEMPORAL_PATCH, y : y + DIGIT, x : x + DIGIT] = shown
            tokens[t, row : row + DIGIT // CELL, col : col + DIGIT // CELL] = digit
            places[t] = (row, col)
        return Clip(frames, digit, start, length, tuple(places), tokens.reshape(-1))

    def questions(self, index: int, clip: Clip | None = None) -> list[Question]:
        """One question of each type about clip ``index`` (QUESTION_TYPES order)."""
        clip = self.clip(index) if clip is None else clip
        return [Question(index, kind, QUESTIONS[kind], answer_of(kind, clip)) for kind in QUESTION_TYPES]
