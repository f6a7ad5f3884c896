"""Canvases of one to three handwritten digits and the questions the digits VLM answers about them.

A canvas is 64×64 pixels, split into four 32×32 quadrants (top left, top right, bottom left, bottom right). It holds
one to three digits of *different* values, each in its own quadrant: the bundled UCI digit (8×8) scaled to 16×16
and placed at one of 3×3 positions on an 8-pixel grid inside its quadrant, so that, with 8×8 patches, every digit
covers exactly 2×2 of the 64 patch tokens and most tokens are empty background.

Questions (word-level, every answer one or two words; ``QUESTION_TYPES``):

* ``which``: "which digit is top left ?" -> "seven" (asked about an occupied quadrant; on a canvas holding one
  digit, half the time just "which digit ?");
* ``where``: "where is the seven ?" -> "top left" (the digits of a canvas differ, so the answer is unique);
* ``count``: "how many digits ?" -> "three" (needs the whole image).

Training conversations ask more (``DigitsScenes.drill``): every quadrant, an empty one answered ``EMPTY_WORD``
("none"), and every digit on the canvas; held-out questions are the three above, about what is on the canvas.

The digits come from the bundled set's own seeded split (:func:`vitrim.data.digits.split_indices`, 20 % held out):
training canvases use training digits only, held-out canvases held-out digits only. Canvas ``i`` of a split is a
pure function of ``(seed, split, epoch, i)`` (held-out canvases ignore the epoch), so nothing random is carried.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vitrim.data.digits import load_digits, split_indices

CANVAS = 64  # pixels; with PATCH 8: 8×8 = 64 image tokens
PATCH = 8
DIGIT = 16  # a digit covers 2×2 patches
QUADRANT = CANVAS // 2
PLACES = (QUADRANT - DIGIT) // PATCH + 1  # 3 positions per axis inside a quadrant
MAX_DIGITS = 3
TEST_FRACTION = 0.2
BACKGROUND = 10  # the patch label of background (Canvas.patch_digits)

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
EMPTY_WORD = "none"  # the answer to "which digit is <quadrant> ?" about an empty quadrant (asked in training)
QUADRANT_WORDS = (("top", "left"), ("top", "right"), ("bottom", "left"), ("bottom", "right"))  # raster order
QUESTION_TYPES = ("which", "where", "count")


@dataclass(frozen=True)
class Canvas:
    """One canvas: its pixels and what is on it.

    pixels: (CANVAS, CANVAS) float32 ink in [0, 1] (0 background).
    digits: per quadrant (0 … 3, raster order) the digit's value, or -1 for an empty quadrant.
    patch_digits: (64,) int64, per patch (raster order) the value of the digit whose 2×2 box covers it, else 10.
    """

    pixels: np.ndarray
    digits: tuple[int, int, int, int]
    patch_digits: np.ndarray

    @property
    def count(self) -> int:
        return sum(d >= 0 for d in self.digits)


@dataclass(frozen=True)
class Question:
    """A question about canvas ``canvas`` of its split, with its answer words and type (one of QUESTION_TYPES)."""

    canvas: int
    kind: str
    words: tuple[str, ...]
    answer: tuple[str, ...]


class DigitsScenes:
    """One split's canvases: ``scenes.canvas(i)`` and the questions about it (``scenes.questions(i)``).

    Args:
        split: ``"train"`` or ``"test"`` (which digits of the bundled set may appear).
        size: canvases in the split (held-out: a fixed set; training: redrawn each epoch, see ``set_epoch``).
        seed: fixes the digits' split and every placement.
        stream: another set of training canvases drawn from the same split (stage 1 of the recipe draws stream 1,
            stage 2 stream 0), so that a stage's canvases differ while its digits stay those of the train split.
            Only ``seed`` decides the split: a glyph of the held-out split never appears on a training canvas.
        augment: distort every glyph put on a training canvas (:func:`distort`: a small random affine map), so
            that a model learns the digits rather than the split's 1438 glyphs. Held-out canvases are never
            distorted.

    ``indices``: the bundled set's indices of the split's glyphs (``glyphs[i]`` is image ``indices[i]``).
    """

    def __init__(self, split: str, size: int, *, seed: int = 0, stream: int = 0, augment: bool = False) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        images, labels = load_digits()
        train_idx, test_idx = split_indices(labels, TEST_FRACTION, seed)
        chosen = train_idx if split == "train" else test_idx
        if not isinstance(stream, int) or stream < 0 or (stream and split != "train"):
            raise ValueError(f"stream must be an int >= 0, and 0 for the held-out split; got {stream!r} ({split})")
        if augment and split != "train":
            raise ValueError(f"augment distorts training canvases only, got augment=True for split {split!r}")
        self.augment = augment
        self.indices = chosen
        scaled = images[chosen].astype(np.float32) / 16.0  # (n, 8, 8) in [0, 1]
        self.glyphs = scaled.repeat(DIGIT // 8, axis=1).repeat(DIGIT // 8, axis=2)  # (n, 16, 16) nearest-neighbour
        self.labels = labels[chosen]
        self.by_value = [np.flatnonzero(self.labels == v) for v in range(10)]
        self.split, self.size, self.seed, self.epoch, self.stream = split, size, seed, 0, stream

    def set_epoch(self, epoch: int) -> None:
        """Draw another set of training canvases (held-out canvases never change)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.size

    def _rng(self, index: int) -> np.random.Generator:
        if self.split == "train" and self.stream:
            return np.random.default_rng([self.seed, 0x71A, self.stream, self.epoch, index])
        if self.split == "train":
            return np.random.default_rng([self.seed, 0x71A, self.epoch, index])
        return np.random.default_rng([self.seed, 0x7E5, index])

    def canvas(self, index: int) -> Canvas:
        if not 0 <= index < self.size:
            raise IndexError(f"canvas {index} out of range for {self.size} canvases")
        rng = self._rng(index)
        # distortions draw from a stream of their own, so a canvas's digits and places are those without them
        warp = np.random.default_rng([self.seed, 0xA06, self.stream, self.epoch, index]) if self.augment else None
        count = int(rng.integers(1, MAX_DIGITS + 1))
        quadrants = rng.choice(4, size=count, replace=False)
        values = rng.choice(10, size=count, replace=False)
        pixels = np.zeros((CANVAS, CANVAS), dtype=np.float32)
        digits = [-1, -1, -1, -1]
        grid = CANVAS // PATCH
        patch_digits = np.full((grid, grid), BACKGROUND, dtype=np.int64)
        for quadrant, value in zip(quadrants, values):
            glyph = self.glyphs[self.glyph_of(value, rng)]
            if warp is not None:
                glyph = distort(glyph, warp)
            y = (quadrant // 2) * QUADRANT + int(rng.integers(PLACES)) * PATCH
            x = (quadrant % 2) * QUADRANT + int(rng.integers(PLACES)) * PATCH
            pixels[y : y + DIGIT, x : x + DIGIT] = glyph
            digits[int(quadrant)] = int(value)
            patch_digits[y // PATCH : (y + DIGIT) // PATCH, x // PATCH : (x + DIGIT) // PATCH] = value
        return Canvas(pixels, (digits[0], digits[1], digits[2], digits[3]), patch_digits.reshape(-1))

    def glyph_of(self, value: int, rng: np.random.Generator) -> int:
        """The position in ``glyphs`` of a glyph of digit ``value`` drawn by ``rng`` (the split's own glyphs only)."""
        return int(rng.choice(self.by_value[value]))

    def questions(self, index: int, canvas: Canvas | None = None) -> list[Question]:
        """One question of each type about canvas ``index`` (which quadrant or digit is asked about is seeded)."""
        canvas = self.canvas(index) if canvas is None else canvas
        rng = np.random.default_rng([self.seed, 0x0A5C, self.epoch if self.split == "train" else 0, index])
        occupied = [q for q, d in enumerate(canvas.digits) if d >= 0]
        asked = occupied[int(rng.integers(len(occupied)))]
        value = DIGIT_WORDS[canvas.digits[asked]]
        which: tuple[str, ...]
        if canvas.count == 1 and rng.random() < 0.5:
            which = ("which", "digit", "?")
        else:
            which = ("which", "digit", "is", *QUADRANT_WORDS[asked], "?")
        where_q = occupied[int(rng.integers(len(occupied)))]
        where_value = DIGIT_WORDS[canvas.digits[where_q]]
        return [
            Question(index, "which", which, (value,)),
            Question(index, "where", ("where", "is", "the", where_value, "?"), QUADRANT_WORDS[where_q]),
            Question(index, "count", ("how", "many", "digits", "?"), (COUNT_WORDS[canvas.count],)),
        ]

    def drill(self, index: int, canvas: Canvas | None = None) -> list[Question]:
        """Every question the canvas answers: "which digit is <q> ?" about all four quadrants (an empty one:
        ``EMPTY_WORD``), "where is the <d> ?" about each of its digits, and "how many digits ?"."""
        canvas = self.canvas(index) if canvas is None else canvas
        asked = [
            Question(index, "which", ("which", "digit", "is", *QUADRANT_WORDS[q], "?"),
                     (DIGIT_WORDS[d] if d >= 0 else EMPTY_WORD,))
            for q, d in enumerate(canvas.digits)
        ]  # fmt: skip
        asked += [
            Question(index, "where", ("where", "is", "the", DIGIT_WORDS[d], "?"), QUADRANT_WORDS[q])
            for q, d in enumerate(canvas.digits)
            if d >= 0
        ]
        return [*asked, Question(index, "count", ("how", "many", "digits", "?"), (COUNT_WORDS[canvas.count],))]


def distort(glyph: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A randomly distorted copy of ``glyph`` (DIGIT×DIGIT ink in [0, 1]): rotated (±0.1 rad), sheared (±0.1),
    scaled (0.9 to 1.05 per axis) and shifted (±1 pixel per axis) about its centre, read bilinearly
    (:func:`warp_glyph`). Small enough that the digit stays inside its 2×2 patches and keeps its value; twice as
    large (with thicker and thinner strokes too) the tower learnt the training glyphs less well (97 % of digit
    patches after 2000 steps) and the held-out ones no better than without distortions (docs/vlm-demo.md)."""
    angle, shear = rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1)  # radians; x moves by shear·y
    scale = rng.uniform(0.9, 1.05, size=2)  # (y, x)
    shift = rng.uniform(-1.0, 1.0, size=2)  # pixels, (y, x)
    cos, sin = np.cos(angle), np.sin(angle)
    linear = np.array([[cos, -sin], [sin, cos]]) @ np.array([[1.0, 0.0], [shear, 1.0]]) @ np.diag(scale)
    return np.clip(warp_glyph(glyph, linear, shift), 0.0, 1.0).astype(np.float32)


def warp_glyph(glyph: np.ndarray, linear: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """``glyph`` (h, w) moved by the affine map ``p -> linear @ (p - c) + c + shift`` about its centre ``c``, (y, x)
    order: each output pixel reads the glyph bilinearly at the inverse map of its own centre (0 ink outside)."""
    h, w = glyph.shape
    centre = np.array([[(h - 1) / 2], [(w - 1) / 2]])
    ys, xs = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")
    source = np.linalg.solve(linear, np.stack([ys.ravel(), xs.ravel()]) - centre - np.reshape(shift, (2, 1)))
    return _bilinear(glyph, *(source + centre)).reshape(h, w)


def _bilinear(image: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``image`` (h, w) read at real coordinates (y, x) (pixel centres at integers), 0 outside."""
    padded = np.pad(image, 1)  # a frame of 0 ink: reads outside see background
    y, x = np.clip(y + 1, 0, image.shape[0] + 0.999), np.clip(x + 1, 0, image.shape[1] + 0.999)
    y0, x0 = np.floor(y).astype(int), np.floor(x).astype(int)
    fy, fx = y - y0, x - x0
    top = padded[y0, x0] * (1 - fx) + padded[y0, x0 + 1] * fx
    bottom = padded[y0 + 1, x0] * (1 - fx) + padded[y0 + 1, x0 + 1] * fx
    return top * (1 - fy) + bottom * fy
