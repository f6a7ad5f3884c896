"""The bundled ``digits`` dataset: 1,797 real handwritten digits, each placed somewhere on a larger empty canvas.

The digits are the 8×8, 17-grey-level images of the UCI "Optical Recognition of Handwritten Digits" set as
scikit-learn ships them (Alpaydin & Kaynak; CC BY 4.0; see DIGITS_LICENSE.txt), stored next to this file as
``digits.npz`` (uint8), so nothing is downloaded and scikit-learn is not needed.

Each sample is one digit scaled up to ``digit_size`` (default half the canvas side: 16×16 on a 32×32 canvas, so
with 4×4 patches a digit covers 16–25 of 64 patches) at a random position, optionally with ``clutter`` fragments
of other digits of the same split and Gaussian ``noise``. Most patches are background: exactly where token
pruning should help.

Placements are a pure function of ``(seed, epoch, index)`` for the training split (re-drawn every epoch through
:meth:`DigitsCanvas.set_epoch`) and of ``(seed, index)`` for the test split (fixed), so a resumed or distributed
run sees exactly the images an uninterrupted single-process run sees, with no random state to carry.

Pixel values: digit ink in [0, 1] on a 0 background, then normalised with mean 0.5 and std 0.5 to [−1, 1].
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

DIGITS_FILE = Path(__file__).with_name("digits.npz")
NUM_CLASSES = 10
MEAN, STD = 0.5, 0.5  # maps [0, 1] to [-1, 1]; image folders use the same


@lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The raw set: images (1797, 8, 8) uint8 with grey levels 0 … 16, labels (1797,) int64 in 0 … 9."""
    with np.load(DIGITS_FILE, allow_pickle=False) as data:
        images, labels = data["images"], data["labels"].astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def check_test_fraction(test_fraction: object) -> float:
    """``test_fraction`` as a float in (0, 1) (a share of each class held out); a ValueError naming it otherwise."""
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be a number in (0, 1), got {test_fraction!r:.80}")
    return float(test_fraction)


def split_indices(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded, stratified split: (train indices, test indices), each sorted; every class keeps its proportion."""
    test_fraction = check_test_fraction(test_fraction)
    rng = np.random.default_rng([seed, 0x5EED])
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        n_test = round(test_fraction * len(members))
        test.append(members[:n_test])
        train.append(members[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _resize_nearest(image: np.ndarray, size: int) -> np.ndarray:
    """(h, w) -> (size, size) by nearest neighbour: each source pixel becomes a block, as a scanner would see it."""
    rows = np.arange(size) * image.shape[0] // size
    cols = np.arange(size) * image.shape[1] // size
    return image[rows[:, None], cols[None, :]]


class DigitsCanvas(Dataset):
    """One split of ``digits`` on a canvas: ``dataset[i] -> (image (in_chans, canvas, canvas) float32, label)``.

    Args:
        split: ``"train"`` or ``"test"`` (a fixed, seeded, stratified split; ``test_fraction`` of each class).
        canvas_size: side of the square canvas in pixels (the model's image size).
        in_chans: 1 (grey) or 3 (the grey image repeated, for models built for RGB).
        digit_size: side of the scaled digit; default half the canvas.
        clutter: fragments (a quarter of a digit's area) of other digits of the same split, placed at random.
        noise: standard deviation of Gaussian pixel noise added to the [0, 1] image before clipping.
        align: the digit's top-left corner lies on multiples of ``align`` pixels (the patch size: every digit covers
            whole patches, so a ViT sees the same patch contents wherever the digit is; 1: any position).
        seed: fixes the split, the test placements and the per-epoch training placements.
    """

    def __init__(
        self,
        split: str = "train",
        *,
        canvas_size: int = 32,
        in_chans: int = 1,
        digit_size: int | None = None,
        clutter: int = 0,
        noise: float = 0.0,
        align: int = 1,
        seed: int = 0,
        test_fraction: float = 0.2,
    ) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if not isinstance(canvas_size, int) or canvas_size < 8:
            raise ValueError(f"canvas_size must be an int >= 8, got {canvas_size!r}")
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3 for digits, got {in_chans!r}")
        digit_size = canvas_size // 2 if digit_size is None else digit_size
        if not isinstance(digit_size, int) or not 4 <= digit_size <= canvas_size:
            raise ValueError(f"digit_size must be an int in [4, canvas_size={canvas_size}], got {digit_size!r}")
        if not isinstance(clutter, int) or clutter < 0:
            raise ValueError(f"clutter must be an int >= 0, got {clutter!r}")
        if not noise >= 0.0:
            raise ValueError(f"noise must be >= 0, got {noise!r}")
        if not isinstance(align, int) or not 1 <= align <= canvas_size - digit_size + 1:
            raise ValueError(f"align must be an int in [1, canvas_size - digit_size + 1], got {align!r}")
        self.split, self.canvas_size, self.in_chans, self.digit_size = split, canvas_size, in_chans, digit_size
        self.clutter, self.noise, self.align, self.seed = clutter, float(noise), align, seed
        images, labels = load_digits()
        train_idx, test_idx = split_indices(labels, test_fraction, seed)
        self.indices = train_idx if split == "train" else test_idx
        self.digits = images[self.indices].astype(np.float32) / 16.0  # (n, 8, 8) in [0, 1]
        self.labels = labels[self.indices]  # (n,)
        self.classes = [str(c) for c in range(NUM_CLASSES)]
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Re-draw the training placements for ``epoch`` (the test placements never change)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.labels)

    def _rng(self, index: int) -> np.random.Generator:
        if self.split == "train":
            return np.random.default_rng([self.seed, 1, self.epoch, index])
        return np.random.default_rng([self.seed, 2, index])

    def render(self, index: int) -> np.ndarray:
        """The canvas of sample ``index`` as (canvas, canvas) float32 in [0, 1], before normalisation."""
        rng = self._rng(index)
        S, d = self.canvas_size, self.digit_size
        canvas = np.zeros((S, S), dtype=np.float32)
        frag = max(2, d // 2)
        for _ in range(self.clutter):
            other = int(rng.integers(len(self.digits) - 1))
            other += other >= index  # never a piece of the digit itself
            piece = _resize_nearest(self.digits[other], d)
            fy, fx = rng.integers(0, d - frag + 1, size=2)
            y, x = rng.integers(0, S - frag + 1, size=2)
            region = canvas[y : y + frag, x : x + frag]
            np.maximum(region, piece[fy : fy + frag, fx : fx + frag], out=region)
        y, x = rng.integers(0, (S - d) // self.align + 1, size=2) * self.align
        region = canvas[y : y + d, x : x + d]
        np.maximum(region, _resize_nearest(self.digits[index], d), out=region)
        if self.noise > 0:
            canvas += rng.normal(0.0, self.noise, size=canvas.shape).astype(np.float32)
            np.clip(canvas, 0.0, 1.0, out=canvas)
        return canvas

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        image = torch.from_numpy(self.render(index)).sub_(MEAN).div_(STD)  # (S, S)
        return image.expand(self.in_chans, -1, -1).clone(), int(self.labels[index])  # (C, S, S)

    def __repr__(self) -> str:
        return (
            f"DigitsCanvas(split={self.split!r}, n={len(self)}, canvas_size={self.canvas_size}, "
            f"digit_size={self.digit_size}, clutter={self.clutter}, noise={self.noise}, seed={self.seed})"
        )
