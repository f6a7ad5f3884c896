"""The bundled digits: the real UCI data, the split, and the canvas placement, checked against hand computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitrim.data import DigitsCanvas, build_datasets, load_digits
from vitrim.data.digits import DIGITS_FILE, split_indices
from vitrim.models.data_config import DataConfig

# scikit-learn's load_digits(): 1,797 samples, these per-class counts, and this first image (a zero)
SKLEARN_CLASS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
SKLEARN_FIRST_IMAGE = [
    [0, 0, 5, 13, 9, 1, 0, 0],
    [0, 0, 13, 15, 10, 15, 5, 0],
    [0, 3, 15, 2, 0, 11, 8, 0],
    [0, 4, 12, 0, 0, 8, 8, 0],
    [0, 5, 8, 0, 0, 9, 8, 0],
    [0, 4, 11, 0, 1, 12, 7, 0],
    [0, 2, 14, 5, 10, 12, 0, 0],
    [0, 0, 6, 13, 10, 0, 0, 0],
]


def test_bundled_file_is_the_uci_set_as_sklearn_ships_it() -> None:
    images, labels = load_digits()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8
    assert images.min() == 0 and images.max() == 16  # 17 grey levels
    assert np.bincount(labels).tolist() == SKLEARN_CLASS_COUNTS
    assert images[0].tolist() == SKLEARN_FIRST_IMAGE and labels[0] == 0
    assert DIGITS_FILE.stat().st_size < 100_000  # small enough to ship
    assert (DIGITS_FILE.parent / "DIGITS_LICENSE.txt").read_text().count("CC BY 4.0") >= 1


def test_split_is_stratified_disjoint_complete_and_seeded() -> None:
    _, labels = load_digits()
    train, test = split_indices(labels, 0.2, seed=0)
    assert len(np.intersect1d(train, test)) == 0
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(1797))
    for c, n in enumerate(SKLEARN_CLASS_COUNTS):
        assert (labels[test] == c).sum() == round(0.2 * n)  # each class keeps its share
    again, _ = split_indices(labels, 0.2, seed=0)
    other, _ = split_indices(labels, 0.2, seed=1)
    assert np.array_equal(train, again) and not np.array_equal(train, other)
    with pytest.raises(ValueError, match="test_fraction"):
        split_indices(labels, 1.0, seed=0)


def test_canvas_holds_the_upscaled_digit_and_mostly_background() -> None:
    ds = DigitsCanvas("test", canvas_size=32, clutter=0, noise=0.0, seed=0)
    images, _ = load_digits()
    for i in range(5):
        canvas = ds.render(i)
        digit = images[ds.indices[i]].astype(np.float32) / 16
        expected = np.kron(digit, np.ones((2, 2), dtype=np.float32))  # 8x8 -> 16x16, each pixel a 2x2 block
        # find the placement: the 16x16 window whose content equals the upscaled digit, with nothing outside it
        matches = [
            (y, x)
            for y in range(17)
            for x in range(17)
            if np.array_equal(canvas[y : y + 16, x : x + 16], expected) and canvas.sum() == expected.sum()
        ]
        assert matches, f"sample {i}: the upscaled digit is not on the canvas"
        patches = canvas.reshape(8, 4, 8, 4).transpose(0, 2, 1, 3).reshape(64, 16)
        assert (patches.max(axis=1) == 0).mean() > 0.5  # most 4x4 patches are empty background


def test_images_are_normalised_and_match_the_model_channels() -> None:
    ds = DigitsCanvas("test", canvas_size=32, in_chans=3, clutter=0, noise=0.0)
    image, label = ds[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert torch.equal(image[0], image[2])
    expected = (torch.from_numpy(ds.render(0)) - 0.5) / 0.5
    assert torch.allclose(image[1], expected) and image.min() == -1.0
    assert label == int(load_digits()[1][ds.indices[0]])


def test_test_placements_are_fixed_and_training_placements_change_per_epoch() -> None:
    test = DigitsCanvas("test", canvas_size=32)
    first = test[3][0]
    test.set_epoch(5)
    assert torch.equal(test[3][0], first)
    train = DigitsCanvas("train", canvas_size=32)
    epoch0 = torch.stack([train[i][0] for i in range(8)])
    assert torch.equal(torch.stack([train[i][0] for i in range(8)]), epoch0)  # same epoch: same images
    train.set_epoch(1)
    epoch1 = torch.stack([train[i][0] for i in range(8)])
    assert not torch.equal(epoch1, epoch0)
    fresh = DigitsCanvas("train", canvas_size=32)
    fresh.set_epoch(1)
    assert torch.equal(torch.stack([fresh[i][0] for i in range(8)]), epoch1)  # a function of (seed, epoch, index)


def test_clutter_comes_from_other_digits_and_noise_is_clipped() -> None:
    clean = DigitsCanvas("test", canvas_size=48, clutter=0, noise=0.0)
    cluttered = DigitsCanvas("test", canvas_size=48, clutter=3, noise=0.0)
    noisy = DigitsCanvas("test", canvas_size=48, clutter=0, noise=0.3)
    assert cluttered.render(0).sum() > clean.render(0).sum()
    n = noisy.render(0)
    assert n.min() >= 0 and n.max() <= 1 and (n > 0).mean() > 0.3


def test_build_datasets_digits_splits() -> None:
    splits = build_datasets("digits", data_config=DataConfig().for_input(1, (32, 32)))
    assert len(splits.train) + len(splits.test) == 1797 and splits.num_classes == 10
    assert len(splits.test) == sum(round(0.2 * n) for n in SKLEARN_CLASS_COUNTS)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(split="val"), "split"),
        (dict(canvas_size=4), "canvas_size"),
        (dict(in_chans=2), "in_chans"),
        (dict(digit_size=40), "digit_size"),
        (dict(clutter=-1), "clutter"),
        (dict(noise=-0.1), "noise"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DigitsCanvas(**kwargs)


def test_non_square_image_size_is_refused() -> None:
    with pytest.raises(ValueError, match="square"):
        build_datasets("digits", data_config=DataConfig().for_input(1, (32, 48)))


def test_aligned_digits_cover_whole_patches() -> None:
    ds = DigitsCanvas("test", canvas_size=32, clutter=0, noise=0.0, align=8)
    corners = set()
    for i in range(60):
        ys, xs = np.nonzero(ds.render(i))
        corners.add((ys.min() // 8 * 8, xs.min() // 8 * 8))
        patches = ds.render(i).reshape(4, 8, 4, 8).transpose(0, 2, 1, 3).reshape(16, 64)
        assert (patches.max(axis=1) > 0).sum() <= 4  # a 16x16 digit on an 8-pixel step touches 4 of 16 patches
    assert corners <= {(y, x) for y in (0, 8, 16) for x in (0, 8, 16)} and len(corners) > 4
    with pytest.raises(ValueError, match="align"):
        DigitsCanvas(canvas_size=32, align=20)
