"""Data: the bundled ``digits``, image folders and WebDataset shards, behind one ``build_datasets``.

Folders and shards are streamed (read when a sample is asked for) and shown to the model as its own weights expect
(``model.data_config``: size, interpolation, crop, mean and std): the eval transform for evaluation, the DeiT
recipe's augmentations for training (:mod:`vitrim.data.augment`). ``digits`` keeps its own pipeline.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from vitrim.data.augment import Augment, MixupCutmix, train_transform
from vitrim.data.digits import DigitsCanvas, check_test_fraction, load_digits
from vitrim.data.folder import ImageFolder, folder_classes, has_split_folders, image_folder_splits, pil_mode
from vitrim.data.loader import ReadableBatches, collate_readable, rebatch
from vitrim.data.shards import ShardDataset, ShardSource, check_streams, is_shard_pattern
from vitrim.data.transforms import eval_transform
from vitrim.data.vision import BuiltTransform
from vitrim.models.data_config import DataConfig


@dataclass
class DataSplits:
    """A train and a test dataset with their class names; each dataset has ``set_epoch(epoch)``.

    A dataset of shards is an IterableDataset (``num_samples`` instead of ``len``); ``source`` names the data for
    messages.
    """

    train: Dataset
    test: Dataset
    classes: list[str]
    source: str = ""

    @property
    def num_classes(self) -> int:
        return len(self.classes)


@functools.cache
def _shards(data: str) -> ShardSource:
    return ShardSource.parse(data)


def dataset_classes(data: str) -> list[str]:
    """Class names of ``data`` (``"digits"``, an image folder or a shard pattern) without decoding any image."""
    if data == "digits":
        return [str(c) for c in range(10)]
    return list(_shards(data).classes) if is_shard_pattern(data) else folder_classes(data)


def check_data(data: str, option: str = "data") -> None:
    """FileNotFoundError / ValueError naming ``option`` (the argument that gave ``data``) when ``data`` is neither
    digits, a folder nor shards."""
    if data == "digits":
        return
    if is_shard_pattern(data):
        _shards(data)
    elif not Path(data).is_dir():
        raise FileNotFoundError(
            f"{option} {data!r} does not exist (expected 'digits', a folder or a .tar shard pattern)"
        )


def build_datasets(
    data: str,
    *,
    data_config: DataConfig,
    augment: Augment | None = None,
    val_data: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    test_fraction: float = 0.2,
    **digits_options: Any,
) -> DataSplits:
    """The train and test datasets of ``data`` for a model that wants ``data_config``.

    ``data``: ``"digits"`` (bundled; ``digits_options`` go to :class:`DigitsCanvas`), an image folder (with
    ``train/`` and ``val/``, or class folders split by ``test_fraction`` and ``seed``) or a shard pattern.
    ``val_data`` (a folder of class folders, or shards) replaces the test split; shards need it to have one.
    ``augment``: the training split's augmentations (None: the eval transform for both splits). ``rank`` and
    ``world_size`` pick this process's shards.
    """
    in_chans, height, width = data_config.input_size
    check_test_fraction(test_fraction)  # here, not where a split first needs it: folders with train/ never do
    check_streams(rank, world_size)
    if data == "digits":
        if height != width:
            raise ValueError(f"digits needs a square image size, got img_size={(height, width)}")
        common: dict[str, Any] = dict(canvas_size=height, in_chans=in_chans, seed=seed, test_fraction=test_fraction)
        train = DigitsCanvas("train", **common, **digits_options)
        test = DigitsCanvas("test", **common, **digits_options)
        return DataSplits(train, test, train.classes, "digits")
    if digits_options:
        raise ValueError(f"options {sorted(digits_options)} apply to data='digits' only, not to {data!r}")
    test_tf = BuiltTransform(eval_transform, data_config)  # pickles as its recipe (vitrim.data.vision)
    train_tf = test_tf if augment is None else BuiltTransform(train_transform, data_config, augment)
    mode = pil_mode(in_chans)
    streams = dict(rank=rank, world_size=world_size, seed=seed)
    if is_shard_pattern(data):
        source = _shards(data)
        train_set: Dataset = ShardDataset(source, train_tf, mode, shuffle=augment is not None, **streams)
        classes = list(source.classes)
        test_set = _val_split(val_data, classes, test_tf, mode, streams) if val_data else None
        if test_set is None:
            raise ValueError(f"data {data!r} is shards: give the evaluation shards or folder as val_data")
        return DataSplits(train_set, test_set, classes, data)
    train_f, test_f = image_folder_splits(
        data,
        train_transform=train_tf,
        test_transform=test_tf,
        in_chans=in_chans,
        test_fraction=test_fraction,
        seed=seed,
    )
    test_set = _val_split(val_data, train_f.classes, test_tf, mode, streams) if val_data else test_f
    return DataSplits(train_f, test_set, train_f.classes, data)


def whole_dataset(
    data: str, *, data_config: DataConfig, rank: int = 0, world_size: int = 1
) -> tuple[Dataset, list[str]]:
    """(every sample of ``data`` under the eval transform, its classes): shards, or a folder of class folders read
    whole (ImageNet's ``val/`` given on its own), with no split held out."""
    transform = BuiltTransform(eval_transform, data_config)
    mode = pil_mode(data_config.input_size[0])
    if is_shard_pattern(data):
        source = _shards(data)
        return ShardDataset(source, transform, mode, rank=rank, world_size=world_size), list(source.classes)
    dataset = ImageFolder.of_class_folders(data, transform, mode)
    return dataset, dataset.classes


def _val_split(val_data: str, classes: list[str], transform: Any, mode: str, streams: dict[str, int]) -> Dataset:
    """The evaluation data given apart: shards, or one folder of class folders with the training data's classes."""
    if is_shard_pattern(val_data):
        source = _shards(val_data)
        found = list(source.classes)
        dataset: Dataset = ShardDataset(source, transform, mode, shuffle=False, **streams)
    else:
        dataset = ImageFolder.of_class_folders(val_data, transform, mode)
        found = dataset.classes
    if found != classes:
        raise ValueError(f"val_data {val_data!r} has classes {found[:5]}… that differ from the training data's")
    return dataset


__all__ = [
    "Augment",
    "DataSplits",
    "DigitsCanvas",
    "ImageFolder",
    "MixupCutmix",
    "ReadableBatches",
    "ShardDataset",
    "ShardSource",
    "build_datasets",
    "check_data",
    "collate_readable",
    "dataset_classes",
    "eval_transform",
    "has_split_folders",
    "image_folder_splits",
    "is_shard_pattern",
    "load_digits",
    "rebatch",
    "train_transform",
    "whole_dataset",
]
