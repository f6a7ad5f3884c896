"""Image folders: ImageNet's layout and torchvision's class order, read lazily, unreadable files skipped and counted."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from vitrim.data import ReadableBatches, build_datasets, collate_readable, dataset_classes, image_folder_splits
from vitrim.data import folder as folder_module
from vitrim.models.data_config import IMAGENET_MEAN, IMAGENET_STD, DataConfig

RGB = DataConfig(input_size=(3, 8, 8), mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=1.0)


def _write(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (10, 12)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for i in range(5):
        _write(tmp_path / "cats" / f"{i}.png", (200, 0, 0))
        _write(tmp_path / "dogs" / "deeper" / f"{i}.JPEG", (0, 0, 255))  # ImageNet's extension, one level down
    return tmp_path


def _identity(image: object) -> object:
    return image


def test_split_and_pixels_normalised_with_the_models_mean_and_std(tree: Path) -> None:
    assert dataset_classes(str(tree)) == ["cats", "dogs"]
    splits = build_datasets(str(tree), data_config=RGB, test_fraction=0.2, seed=0)
    assert (len(splits.train), len(splits.test)) == (8, 2)  # one of five per class held out
    assert sorted(splits.test.labels.tolist()) == [0, 1]  # type: ignore[attr-defined]
    image, label = splits.train[int((splits.train.labels == 0).nonzero()[0][0])]  # type: ignore[attr-defined]
    assert image.shape == (3, 8, 8) and label == 0
    # a solid (200, 0, 0) PNG: (v / 255 - mean) / std per channel, by hand
    expected = torch.tensor(
        [(200 / 255 - IMAGENET_MEAN[0]) / IMAGENET_STD[0]]
        + [-m / s for m, s in zip(IMAGENET_MEAN[1:], IMAGENET_STD[1:])]
    )
    torch.testing.assert_close(image.mean(dim=(1, 2)), expected, atol=1e-5, rtol=0)


def test_grey_models_get_luminance(tree: Path) -> None:
    grey = DataConfig(input_size=(1, 8, 8), mean=(0.5,), std=(0.5,), crop_pct=1.0)
    splits = build_datasets(str(tree), data_config=grey)
    image, _ = splits.train[int((splits.train.labels == 1).nonzero()[0][0])]  # type: ignore[attr-defined]
    assert image.shape == (1, 8, 8)
    luma = round(0.114 * 255)  # Pillow's ITU-R 601-2 luma: L = R*299/1000 + G*587/1000 + B*114/1000
    torch.testing.assert_close(image, torch.full_like(image, luma / 255 * 2 - 1), atol=1 / 255, rtol=0)


def test_imagenet_layout_numbers_classes_as_torchvision(tmp_path: Path) -> None:
    names = ["n02", "n10", "n01", "B", "a"]  # sorted() order, as torchvision: uppercase before lowercase
    for split, n in (("train", 3), ("val", 2)):
        for k, name in enumerate(names):
            for i in range(n):
                _write(tmp_path / split / name / f"{i}.jpeg", (40 * k, 0, 0))
    from torchvision.datasets import ImageFolder as TorchvisionImageFolder  # the reference

    references = {split: TorchvisionImageFolder(str(tmp_path / split)) for split in ("train", "val")}
    (tmp_path / "train" / ".ipynb_checkpoints").mkdir()  # a hidden folder is no class (torchvision would fail)
    splits = build_datasets(str(tmp_path), data_config=RGB)
    assert (len(splits.train), len(splits.test)) == (15, 10)
    for split, ours in (("train", splits.train), ("val", splits.test)):
        reference = references[split]
        assert ours.classes == reference.classes == splits.classes  # type: ignore[attr-defined]
        got = sorted((str(Path(ours.root) / f.decode()), int(y)) for f, y in zip(ours.files, ours.labels))  # type: ignore[attr-defined]
        assert got == sorted(reference.samples)


def test_building_reads_no_image(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an image was opened while the dataset was built")

    monkeypatch.setattr(folder_module, "open_image", refuse)
    train, test = image_folder_splits(tree, train_transform=_identity, test_transform=_identity, in_chans=3)
    assert len(train) + len(test) == 10


def test_unreadable_files_are_skipped_counted_across_workers_and_warned_once(tree: Path) -> None:
    (tree / "cats" / "garbage.png").write_bytes(b"not an image at all")
    good = (tree / "dogs" / "deeper" / "0.JPEG").read_bytes()
    (tree / "dogs" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (tree / "dogs" / "notes.txt").write_text("ignored: not an image extension")
    splits = build_datasets(str(tree), data_config=RGB, test_fraction=0.5)
    assert len(splits.train) + len(splits.test) == 12  # listed: every image name, readable or not
    both = torch.utils.data.ConcatDataset([splits.train, splits.test])
    loader = DataLoader(both, batch_size=3, num_workers=2, collate_fn=collate_readable)
    batches = ReadableBatches(loader, str(tree))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        labels = [torch.cat([y for _, y in batches]) for _ in range(2)]  # two passes
    messages = [str(w.message) for w in caught]
    assert messages == [f"skipped 2 unreadable image(s) in {tree}"]  # once, after the first pass
    assert batches.num_skipped == 4  # both passes counted
    assert all(sorted(y.tolist()) == [0] * 5 + [1] * 5 for y in labels)  # every good file kept


def test_missing_or_empty_folders_give_clear_errors(tmp_path: Path) -> None:
    kwargs = dict(train_transform=_identity, test_transform=_identity, in_chans=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        image_folder_splits(tmp_path / "nope", **kwargs)  # type: ignore[arg-type]
    (tmp_path / "only").mkdir()
    with pytest.raises(ValueError, match="class folder"):
        image_folder_splits(tmp_path, **kwargs)  # type: ignore[arg-type]
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match=r"no images"):
        image_folder_splits(tmp_path, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="digits"):
        build_datasets(str(tmp_path), data_config=RGB, clutter=2)
    with pytest.raises(ValueError, match="in_chans=2"):
        image_folder_splits(tmp_path, train_transform=_identity, test_transform=_identity, in_chans=2)
