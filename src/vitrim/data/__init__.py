"""Data: the bundled ``digits`` dataset and image folders, behind one ``build_datasets``; a model's own
preprocessing (``eval_transform(model.data_config)``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from vitrim.data.digits import DigitsCanvas, load_digits
from vitrim.data.folder import ImageFolder, folder_classes, image_folder_splits
from vitrim.data.transforms import eval_transform


@dataclass
class DataSplits:
    """A train and a test dataset with their class names; each dataset has ``set_epoch(epoch)``."""

    train: Dataset
    test: Dataset
    classes: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def dataset_classes(data: str) -> list[str]:
    """Class names of ``data`` (``"digits"`` or an image folder) without decoding any image."""
    return [str(c) for c in range(10)] if data == "digits" else folder_classes(data)


def build_datasets(
    data: str,
    *,
    img_size: tuple[int, int],
    in_chans: int,
    seed: int = 0,
    test_fraction: float = 0.2,
    **digits_options: Any,
) -> DataSplits:
    """``data``: ``"digits"`` (bundled; ``digits_options`` go to :class:`DigitsCanvas`) or an image-folder path.

    ``img_size`` (H, W) and ``in_chans`` are the model's: images are made to fit the model, not the other way round.
    """
    if data == "digits":
        if img_size[0] != img_size[1]:
            raise ValueError(f"digits needs a square image size, got img_size={tuple(img_size)}")
        common: dict[str, Any] = dict(
            canvas_size=img_size[0], in_chans=in_chans, seed=seed, test_fraction=test_fraction
        )
        train = DigitsCanvas("train", **common, **digits_options)
        test = DigitsCanvas("test", **common, **digits_options)
        return DataSplits(train, test, train.classes)
    if digits_options:
        raise ValueError(f"options {sorted(digits_options)} apply to data='digits' only, not to {data!r}")
    train_f, test_f = image_folder_splits(
        data, img_size=(img_size[0], img_size[1]), in_chans=in_chans, test_fraction=test_fraction, seed=seed
    )
    return DataSplits(train_f, test_f, train_f.classes)


__all__ = [
    "DataSplits",
    "DigitsCanvas",
    "ImageFolder",
    "build_datasets",
    "dataset_classes",
    "eval_transform",
    "image_folder_splits",
    "load_digits",
]
