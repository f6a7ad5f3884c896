"""Image folders (ImageNet's layout), read lazily: a file is opened when its sample is asked for, in a worker.

``ROOT`` holds ``train/`` and ``val/`` (or ``test/``) folders of class folders, as ImageNet is laid out, or the class
folders themselves (then a seeded, stratified split makes train and test). Class ``i`` is the i-th class folder in
sorted order, as torchvision's and timm's ImageFolder number them; images are found in a class folder at any depth
(extensions as torchvision's, any case: ImageNet's are ``.JPEG``).

Building a dataset lists file names only, so it starts at once on a million files and holds them as two numpy arrays
(a byte string and a label per file): DataLoader workers that fork from it share those pages instead of copying a
Python list object by object. A file Pillow cannot read (corrupt, truncated, not an image) is found when its sample
is loaded: the sample comes back as ``None``, and :mod:`vitrim.data.loader` drops it from the batch and counts it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

from vitrim.data.digits import split_indices
from vitrim.data.image_file import ImageRefused, open_image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's
TEST_FOLDER_NAMES = ("val", "test")
Transform = Callable[[Any], Tensor]  # PIL image -> (C, H, W) tensor


def pil_mode(in_chans: int) -> str:
    """The Pillow mode a model with ``in_chans`` channels reads images in: ``L`` (luma) for 1, ``RGB`` for 3."""
    if in_chans not in (1, 3):
        raise ValueError(f"images can be read for models with 1 or 3 input channels, not in_chans={in_chans}")
    return "L" if in_chans == 1 else "RGB"


class ImageFolder(Dataset):
    """``dataset[i] -> (transform(image), label)``, or None when the file cannot be decoded (module doc).

    Build it with :func:`image_folder_splits`. ``root`` / ``files`` (relative paths) and ``labels`` say what it holds.
    """

    def __init__(
        self,
        root: str | Path,
        files: list[str],
        labels: list[int],
        classes: list[str],
        transform: Transform,
        mode: str,
        *,
        num_unlisted: int = 0,
    ) -> None:
        self.root = str(root)
        self.num_unlisted = num_unlisted  # files left out when listing (:func:`_list_files`), reported as unreadable
        self.files = np.array([f.encode() for f in files], dtype=np.bytes_)  # (n,) one block of bytes
        self.labels = np.array(labels, dtype=np.int64)  # (n,)
        self.classes = classes
        self.transform = transform
        self.mode = mode

    @classmethod
    def of_class_folders(cls, root: str | Path, transform: Transform, mode: str) -> ImageFolder:
        """Every image of one folder of class folders (a ``val/`` given on its own)."""
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"data folder {str(root)!r} does not exist (expected one folder per class)")
        classes = _class_folders(root)
        files, labels, unlisted = _list_files(root, classes)
        if not files:
            raise ValueError(f"data folder {str(root)!r} has no images ({', '.join(IMAGE_EXTENSIONS)})")
        return cls(root, files, labels, classes, transform, mode, num_unlisted=unlisted)

    def set_epoch(self, epoch: int) -> None:
        """Nothing to re-draw here (augmentation draws from the worker's seed); every dataset has this method."""

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int] | None:
        path = os.path.join(self.root, self.files[index].decode())
        try:
            image = open_image(path, self.mode)
        except Exception:  # Pillow raises many kinds on a bad file; the loader counts it, a run never stops for it
            return None
        try:
            return self.transform(image), int(self.labels[index])
        except ImageRefused:  # too large once resized (vitrim.data.transforms.ResizeGuard): counted, as a bad file
            return None


def _list_files(root: Path, classes: list[str]) -> tuple[list[str], list[int], int]:
    """(paths relative to ``root``, labels, files left out) of every image under each class folder, sorted within a
    class.

    A folder comes from outside, so the walk follows a link only to a folder inside the class folder that it has not
    entered yet (``a/up -> ..`` would list every file again at each level, or another class's files under this one),
    lists regular files only (a FIFO named ``x.png`` would block its reader forever), and leaves out files whose names
    are not UTF-8 or whose link leads out of ``root``: those are counted, as unreadable files are.
    """
    top = os.path.realpath(root)
    files: list[str] = []
    labels: list[int] = []
    left_out = 0
    for label, name in enumerate(classes):
        found: list[str] = []
        class_top = os.path.realpath(os.path.join(top, name))
        pending = [os.path.join(top, name)] if _inside(class_top, top) else []
        entered: set[tuple[int, int]] = set()
        while pending:
            folder = pending.pop()
            try:
                info = os.stat(folder)
                entries = list(os.scandir(folder))
            except OSError:  # vanished, or not readable: nothing of it can be listed
                continue
            if (info.st_dev, info.st_ino) in entered:
                continue
            entered.add((info.st_dev, info.st_ino))
            for entry in entries:
                if entry.is_dir():
                    if _inside(entry.path, class_top) and not entry.name.startswith("."):
                        pending.append(entry.path)
                elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                    if _inside(entry.path, top) and _utf8(entry.name) and _utf8(entry.path) and _regular(entry):
                        found.append(os.path.relpath(entry.path, top))
                    else:
                        left_out += 1
        found.sort()
        files += found
        labels += [label] * len(found)
    return files, labels, left_out


def _inside(path: str, top: str) -> bool:
    """Whether ``path``, its links resolved, lies in ``top`` (itself resolved)."""
    real = os.path.realpath(path)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")  # a name that is not UTF-8 on disk holds surrogate escapes here
    except UnicodeEncodeError:
        return False
    return True


def _regular(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()  # follows a link; False for FIFOs, sockets and devices
    except OSError:
        return False


def _class_folders(root: Path) -> list[str]:
    """The class folders of ``root``, sorted; a name that is not UTF-8 is refused, since leaving it out would shift
    the label of every class after it."""
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    bad = next((n for n in names if not _utf8(n)), None)
    if bad is not None:
        raw = bad.encode(errors="surrogateescape")
        raise ValueError(f"data folder {str(root)!r} has a class folder whose name is not UTF-8 ({raw!r}); rename it")
    return names


def _layout(root: Path) -> tuple[list[str], Path, Path | None]:
    """(class names, train folder, test folder or None when the split is made by sampling)."""
    if not root.is_dir():
        raise FileNotFoundError(f"data folder {str(root)!r} does not exist (expected one folder per class)")
    test_root = next((root / n for n in TEST_FOLDER_NAMES if (root / n).is_dir()), None)
    train_root = root / "train" if (root / "train").is_dir() and test_root is not None else root
    classes = _class_folders(train_root)
    if len(classes) < 2:
        raise ValueError(f"data folder {str(root)!r} has {len(classes)} class folder(s); expected at least 2")
    return classes, train_root, test_root if train_root != root else None


def has_split_folders(root: str | Path) -> bool:
    """Whether ``root`` holds ``train/`` and ``val/`` (or ``test/``) rather than the class folders themselves."""
    return _layout(Path(root))[2] is not None


def folder_classes(root: str | Path) -> list[str]:
    """The class names of an image-folder tree (sorted folder names), without reading any image."""
    return _layout(Path(root))[0]


def image_folder_splits(
    root: str | Path,
    *,
    train_transform: Transform,
    test_transform: Transform,
    in_chans: int,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[ImageFolder, ImageFolder]:
    """(train, test) datasets of an image-folder tree (module doc); nothing is decoded here."""
    root = Path(root)
    mode = pil_mode(in_chans)
    classes, train_root, test_root = _layout(root)
    if test_root is not None:
        train_files, train_labels, train_unlisted = _list_files(train_root, classes)
        test_files, test_labels, test_unlisted = _list_files(test_root, classes)
    else:
        files, labels, test_unlisted = _list_files(root, classes)  # reported with the split that is evaluated
        train_unlisted = 0
        train_files, train_labels, test_files, test_labels = [], [], [], []
        if files:
            train_idx, test_idx = split_indices(np.array(labels), test_fraction, seed)
            train_files, train_labels = [files[i] for i in train_idx], [labels[i] for i in train_idx]
            test_files, test_labels = [files[i] for i in test_idx], [labels[i] for i in test_idx]
    if not train_files or not test_files:
        raise ValueError(f"data folder {str(root)!r} has no images ({', '.join(IMAGE_EXTENSIONS)}) in some split")
    train = ImageFolder(
        train_root, train_files, train_labels, classes, train_transform, mode, num_unlisted=train_unlisted
    )
    test = ImageFolder(
        test_root or root, test_files, test_labels, classes, test_transform, mode, num_unlisted=test_unlisted
    )
    return train, test
