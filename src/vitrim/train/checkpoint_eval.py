"""Evaluate a saved checkpoint on the test split its run held out (what ``vitrim eval`` runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from vitrim.data import build_datasets
from vitrim.train.config import TrainConfig
from vitrim.train.distributed import barrier, cleanup_distributed, setup_distributed
from vitrim.train.evaluate import evaluate
from vitrim.train.loop import input_spec
from vitrim.train.state import load_for_eval

# the data options a run records; a checkpoint is evaluated on its own run's split unless told otherwise
DATA_OPTIONS = ("data", "seed", "test_fraction", "clutter", "noise", "align")


@dataclass(frozen=True)
class CheckpointSplit:
    """A trained model (eval mode, CPU) and the split of the data its run held out (or trained on)."""

    model: nn.Module
    run: dict[str, Any]  # the run record ({} if the checkpoint has none)
    data: str  # "digits" or an image folder
    classes: list[str]
    dataset: Dataset
    num_classes: int


def load_checkpoint_split(checkpoint: str | Path, *, split: str = "test", **data_options: Any) -> CheckpointSplit:
    """The checkpoint's model and its run's ``split``; ``data_options`` (not None) override the run's own."""
    if split not in ("test", "train"):
        raise ValueError(f"split must be 'test' or 'train', got {split!r}")
    model, run = load_for_eval(checkpoint)
    defaults = TrainConfig.defaults()
    options = {k: run.get(k, defaults[k]) for k in DATA_OPTIONS}
    options.update({k: v for k, v in data_options.items() if v is not None})
    data = options.pop("data")
    if data != "digits":
        for key in ("clutter", "noise", "align"):
            options.pop(key)
    if data != "digits" and not Path(data).is_dir():
        raise FileNotFoundError(f"data folder {data!r} does not exist (expected 'digits' or a folder)")
    img_size, in_chans = input_spec(model)
    splits = build_datasets(data, img_size=img_size, in_chans=in_chans, **options)
    num_classes = int(getattr(model.config, "num_classes", splits.num_classes))
    if num_classes != splits.num_classes:
        raise ValueError(f"the model predicts {num_classes} classes but data {data!r} has {splits.num_classes}")
    dataset = splits.test if split == "test" else splits.train
    return CheckpointSplit(model, run, data, list(splits.classes), dataset, num_classes)


def evaluate_checkpoint(
    checkpoint: str | Path,
    *,
    split: str = "test",
    batch_size: int = 256,
    bf16: bool = False,
    device: str = "auto",
    **data_options: Any,
) -> dict[str, Any]:
    """Metrics of a checkpoint (see :func:`vitrim.train.evaluate.evaluate`); data options default to the run's."""
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch size must be a positive int, got {batch_size!r}")
    loaded = load_checkpoint_split(checkpoint, split=split, **data_options)
    info = setup_distributed(device)
    try:
        model = loaded.model.to(info.device)
        metrics = evaluate(
            model, loaded.dataset, num_classes=loaded.num_classes, batch_size=batch_size, info=info, bf16=bf16
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
