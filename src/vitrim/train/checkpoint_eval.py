"""Evaluate a saved checkpoint on the test split its run held out (what ``vitrim eval`` runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from vitrim.data import build_datasets, check_data, has_split_folders, is_shard_pattern, whole_dataset
from vitrim.data.shards import check_local
from vitrim.train.config import TrainConfig
from vitrim.train.distributed import DistInfo, barrier, cleanup_distributed, setup_distributed
from vitrim.train.evaluate import evaluate
from vitrim.train.loaders import resolve_workers
from vitrim.train.loop import model_data_config
from vitrim.train.state import RUN_RECORD, load_for_eval

# the data options a run records; a checkpoint is evaluated on its own run's split unless told otherwise
DATA_OPTIONS = ("data", "val_data", "seed", "test_fraction", "clutter", "noise", "align")


@dataclass(frozen=True)
class CheckpointSplit:
    """A trained model (eval mode, CPU) and the split of the data its run held out (or trained on)."""

    model: nn.Module
    run: dict[str, Any]  # the run record ({} if the checkpoint has none)
    data: str  # "digits" or an image folder
    classes: list[str]
    dataset: Dataset
    num_classes: int


def load_checkpoint_split(
    checkpoint: str | Path, *, split: str = "test", info: DistInfo | None = None, **data_options: Any
) -> CheckpointSplit:
    """The checkpoint's model and its run's ``split``; ``data_options`` (not None) override the run's own.

    Data other than the run's own, given as ``data`` with no ``val_data``, is evaluated whole when it has no split
    of its own (shards, or a folder of class folders such as ImageNet's ``val/``); a folder with ``train/`` and
    ``val/`` is evaluated on ``val/``. ``info`` picks this rank's shards under torchrun.
    """
    if split not in ("test", "train"):
        raise ValueError(f"split must be 'test' or 'train', got {split!r}")
    info = info or DistInfo()
    model, run = load_for_eval(checkpoint)
    defaults = TrainConfig.defaults()
    options = {k: run.get(k, defaults[k]) for k in DATA_OPTIONS}
    if data_options.get("data") is not None:
        options["val_data"] = None  # other data: its own evaluation split, not the run's
    options.update({k: v for k, v in data_options.items() if v is not None})
    for name in ("data", "val_data"):  # what the run's record names is opened only if it is local (no pipe:, URL)
        if options[name] is not None and data_options.get(name) is None and name in run:
            check_local(options[name], f"{_record_name(checkpoint)}: {name!r}")
    data = options.pop("data")
    if data != "digits":
        for key in ("clutter", "noise", "align"):
            options.pop(key)
    check_data(data, "--data" if data_options.get("data") is not None else "run.json's 'data'")
    other = data_options.get("data") is not None and data != run.get("data")
    whole = is_shard_pattern(data) or (other and data != "digits" and not has_split_folders(data))
    data_config = model_data_config(model, run)
    if whole and options["val_data"] is None:  # no split of its own: every image is evaluated, none held out
        dataset, classes = whole_dataset(data, data_config=data_config, rank=info.rank, world_size=info.world_size)
    else:
        splits = build_datasets(data, data_config=data_config, rank=info.rank, world_size=info.world_size, **options)
        dataset, classes = (splits.test if split == "test" else splits.train), list(splits.classes)
    num_classes = int(getattr(model.config, "num_classes", len(classes)))
    if num_classes != len(classes):
        raise ValueError(f"the model predicts {num_classes} classes but data {data!r} has {len(classes)}")
    return CheckpointSplit(model, run, data, classes, dataset, num_classes)


def _record_name(checkpoint: str | Path) -> str:
    return str(Path(checkpoint).parent / RUN_RECORD) if Path(checkpoint).suffix != ".pt" else f"{str(checkpoint)!r}"


def evaluate_checkpoint(
    checkpoint: str | Path,
    *,
    split: str = "test",
    batch_size: int = 256,
    bf16: bool = False,
    device: str = "auto",
    workers: int | None = None,
    progress: bool = False,
    **data_options: Any,
) -> dict[str, Any]:
    """Metrics of a checkpoint (see :func:`vitrim.train.evaluate.evaluate`); data options default to the run's."""
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch size must be a positive int, got {batch_size!r}")
    info = setup_distributed(device)
    try:
        loaded = load_checkpoint_split(checkpoint, split=split, info=info, **data_options)
        model = loaded.model.to(info.device)
        metrics = evaluate(
            model,
            loaded.dataset,
            num_classes=loaded.num_classes,
            batch_size=batch_size,
            info=info,
            bf16=bf16,
            workers=resolve_workers(workers, loaded.data),
            source=loaded.data,
            progress=progress and info.is_main,
        )
        barrier(info)
    finally:
        cleanup_distributed()
    return {
        "checkpoint": str(checkpoint),
        "model": loaded.run.get("model", type(model).__name__),
        "data": loaded.data,
        "split": split,
        "classes": loaded.classes,
        **metrics,
    }
