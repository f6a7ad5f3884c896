"""Image folders: class folders, channel conversion and resizing, corrupt files skipped and counted."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitrim.data import build_datasets, dataset_classes, image_folder_splits


def _write(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (10, 12)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for i in range(5):
        _write(tmp_path / "cats" / f"{i}.png", (200, 0, 0))
        _write(tmp_path / "dogs" / f"{i}.jpg", (0, 0, 255))
    return tmp_path


def test_classes_split_and_pixels(tree: Path) -> None:
    assert dataset_classes(str(tree)) == ["cats", "dogs"]
    train, test = image_folder_splits(tree, img_size=(8, 8), in_chans=3, test_fraction=0.2, seed=0)
    assert (len(train), len(test)) == (8, 2)  # one of five per class held out
    assert sorted(test.labels.tolist()) == [0, 1]
    image, label = train[int((train.labels == 0).nonzero()[0])]
    assert image.shape == (3, 8, 8) and label == 0
    # a solid (200, 0, 0) PNG: (v / 255 - 0.5) / 0.5 per channel, by hand
    expected = torch.tensor([200 / 255 * 2 - 1, -1.0, -1.0])
    assert torch.allclose(image.mean(dim=(1, 2)), expected, atol=1e-6)


def test_grey_models_get_luminance(tree: Path) -> None:
    train, _ = image_folder_splits(tree, img_size=(8, 8), in_chans=1)
    image, _ = train[int((train.labels == 1).nonzero()[0])]
    assert image.shape == (1, 8, 8)
    grey = round(0.114 * 255)  # Pillow's ITU-R 601-2 luma: L = R*299/1000 + G*587/1000 + B*114/1000
    assert torch.allclose(image, torch.full_like(image, grey / 255 * 2 - 1), atol=1 / 255)


def test_corrupt_and_truncated_images_are_skipped_counted_and_warned_once(tree: Path) -> None:
    (tree / "cats" / "garbage.png").write_bytes(b"not an image at all")
    good = (tree / "dogs" / "0.jpg").read_bytes()
    (tree / "dogs" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (tree / "dogs" / "notes.txt").write_text("ignored: not an image extension")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train, test = image_folder_splits(tree, img_size=(8, 8), in_chans=3, test_fraction=0.2, seed=0)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "skipped 2 unreadable image(s)" in messages[0]
    assert train.num_skipped + test.num_skipped == 2
    assert len(train) + len(test) == 10  # every good file kept


def test_train_and_test_folders_are_used_as_given(tmp_path: Path) -> None:
    for split, n in (("train", 3), ("test", 2)):
        for cls, colour in (("a", (0, 0, 0)), ("b", (255, 255, 255))):
            for i in range(n):
                _write(tmp_path / split / cls / f"{i}.png", colour)
    splits = build_datasets(str(tmp_path), img_size=(4, 4), in_chans=1)
    assert splits.classes == ["a", "b"] and (len(splits.train), len(splits.test)) == (6, 4)
    assert np.allclose(splits.test[len(splits.test) - 1][0].numpy(), 1.0)


def test_missing_or_empty_folders_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        image_folder_splits(tmp_path / "nope", img_size=(8, 8), in_chans=3)
    (tmp_path / "only").mkdir()
    with pytest.raises(ValueError, match="class folder"):
        image_folder_splits(tmp_path, img_size=(8, 8), in_chans=3)
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match=r"no .* images"):
        image_folder_splits(tmp_path, img_size=(8, 8), in_chans=3)
    with pytest.raises(ValueError, match="digits"):
        build_datasets(str(tmp_path), img_size=(8, 8), in_chans=3, clutter=2)
