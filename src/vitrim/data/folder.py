"""Image-folder datasets: ``ROOT/<class>/<image>`` (PNG/JPEG through Pillow), one folder per class.

``ROOT`` either holds the class folders directly (a seeded, stratified split makes train and test), or holds
``train/`` and ``test/`` (or ``val/``) folders that each hold the class folders.

Every image is decoded once when the dataset is built; files Pillow cannot read (corrupt, truncated, not an
image) are skipped and counted, with one warning naming the count, so a bad file never crashes a run. Images are
converted to the model's channels (``L`` for 1, ``RGB`` for 3), resized to its size and normalised with mean 0.5
and std 0.5, like ``digits``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from vitrim.data.digits import split_indices
from vitrim.data.images import decode_image, normalise

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
TEST_FOLDER_NAMES = ("test", "val")


def _class_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


class ImageFolder(Dataset):
    """Decoded images of some files: ``dataset[i] -> (image (in_chans, H, W) float32 in [−1, 1], label)``.

    Build it with :func:`image_folder_splits`; ``num_skipped`` counts the files that could not be read.
    """

    def __init__(self, files: list[tuple[Path, int]], classes: list[str], size: tuple[int, int], in_chans: int):
        images, labels, skipped = [], [], 0
        for path, label in files:
            try:
                images.append(decode_image(path, size, in_chans))
            except Exception:  # (Pillow raises many kinds; a bad file must never stop a run)
                skipped += 1
                continue
            labels.append(label)
        self.classes = classes
        self.num_skipped = skipped
        shape = (0, in_chans, *size)
        self.images = torch.from_numpy(np.stack(images)) if images else torch.empty(shape, dtype=torch.uint8)
        self.labels = torch.tensor(labels, dtype=torch.long)

    def set_epoch(self, epoch: int) -> None:
        """Nothing to re-draw (no augmentation); present so every dataset has the same interface."""

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        image = normalise(self.images[index])  # (C, H, W)
        return image, int(self.labels[index])


def _list_files(root: Path, classes: list[str]) -> list[tuple[Path, int]]:
    files = []
    for label, name in enumerate(classes):
        folder = root / name
        if folder.is_dir():
            files += [(p, label) for p in sorted(folder.rglob("*")) if p.suffix.lower() in IMAGE_EXTENSIONS]
    return files


def _layout(root: Path) -> tuple[list[str], Path, Path | None]:
    """(class names, train folder, test folder or None when the split is made by sampling)."""
    if not root.is_dir():
        raise FileNotFoundError(f"data folder {str(root)!r} does not exist (expected one folder per class)")
    test_root = next((root / n for n in TEST_FOLDER_NAMES if (root / n).is_dir()), None)
    train_root = root / "train" if (root / "train").is_dir() and test_root is not None else root
    classes = [p.name for p in _class_folders(train_root)]
    if len(classes) < 2:
        raise ValueError(f"data folder {str(root)!r} has {len(classes)} class folder(s); expected at least 2")
    return classes, train_root, test_root if train_root != root else None


def folder_classes(root: str | Path) -> list[str]:
    """The class names of an image-folder tree (sorted folder names), without reading any image."""
    return _layout(Path(root))[0]


def image_folder_splits(
    root: str | Path, *, img_size: tuple[int, int], in_chans: int, test_fraction: float = 0.2, seed: int = 0
) -> tuple[ImageFolder, ImageFolder]:
    """(train, test) datasets from an image-folder tree (see module doc). Warns once if files were skipped."""
    root = Path(root)
    if in_chans not in (1, 3):
        raise ValueError(f"in_chans must be 1 or 3 for image folders, got {in_chans!r}")
    classes, train_root, test_root = _layout(root)
    if test_root is not None:
        train_files, test_files = _list_files(train_root, classes), _list_files(test_root, classes)
    else:
        files = _list_files(root, classes)
        train_files, test_files = [], []
        if files:
            train_idx, test_idx = split_indices(np.array([label for _, label in files]), test_fraction, seed)
            train_files, test_files = [files[i] for i in train_idx], [files[i] for i in test_idx]
    if not train_files or not test_files:
        raise ValueError(f"data folder {str(root)!r} has no {'/'.join(IMAGE_EXTENSIONS)} images in some split")
    train = ImageFolder(train_files, classes, img_size, in_chans)
    test = ImageFolder(test_files, classes, img_size, in_chans)
    skipped = train.num_skipped + test.num_skipped
    if skipped:
        warnings.warn(f"skipped {skipped} unreadable image(s) under {str(root)!r}", stacklevel=2)
    if len(train) == 0 or len(test) == 0:
        raise ValueError(f"data folder {str(root)!r}: no readable images left in the train or test split")
    return train, test
