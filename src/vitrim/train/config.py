"""The settings of one training run: defaults written once, here (``vitrim train`` reads its defaults from them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitrim.data import Augment, check_data, is_shard_pattern
from vitrim.factory import create_model
from vitrim.models import list_models
from vitrim.reduce.dynamic import check_keep_ratio


@dataclass
class TrainConfig:
    """Settings of one run; ``vitrim train`` fills it from the command line. Defaults suit a small ViT on digits."""

    model: str
    data: str = "digits"
    out: str = "runs/train"
    epochs: int = 10
    overrides: dict[str, Any] = field(default_factory=dict)  # create_model(**overrides), timm's names
    batch_size: int = 64  # global: split over ranks under torchrun
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    min_lr_factor: float = 0.01  # the cosine ends at lr × this
    label_smoothing: float = 0.1
    clip_grad: float | None = 1.0  # max global gradient norm; None: no clipping
    bf16: bool = False
    seed: int = 0
    resume: bool = False
    quiet: bool = False
    device: str = "auto"
    eval_batch_size: int = 256
    test_fraction: float = 0.2
    clutter: int = 0  # digits only: fragments of other digits per image
    noise: float = 0.0  # digits only: std of Gaussian pixel noise
    align: int = 1  # digits only: the digit's corner on multiples of this many pixels
    # image folders and shards (vitrim.data): where evaluation data comes from, how it is read, how training augments
    val_data: str | None = None  # evaluation folder or shards; None: the folder's val/ (or a held-out share)
    workers: int | None = None  # DataLoader processes; None: none for digits, min(4, cores) for files
    accum_steps: int = 1  # micro-batches per optimiser step (batch_size stays the step's global batch)
    scale: tuple[float, float] = (0.08, 1.0)  # the DeiT recipe (vitrim.data.augment.Augment); digits keep their own
    hflip: float = 0.5
    randaugment: int = 9  # magnitude; 0: off
    reprob: float = 0.25  # random erasing
    mixup: float = 0.8  # Beta α; 0: off
    cutmix: float = 1.0  # Beta α; 0: off
    # DynamicViT fine-tuning from a dense checkpoint (see vitrim.reduce.dynamicvit_training)
    teacher: str | None = None
    backbone_lr_scale: float = 0.01
    freeze_backbone_epochs: int = 1
    distill: dict[str, Any] = field(default_factory=dict)  # keyword arguments of vitrim.losses.DynamicViTLoss
    # MCTF models (reducer=mctf): token-reduction consistency; keyword arguments of
    # vitrim.reduce.mctf_training.MCTFObjective
    mctf: dict[str, Any] = field(default_factory=dict)

    def objective_options(self) -> dict[str, Any]:
        """The settings a reducer's training objective reads (``Reducer.training_objective``), by name."""
        return {
            "mctf": self.mctf,
            "distill": self.distill,
            "backbone_lr_scale": self.backbone_lr_scale,
            "freeze_backbone_epochs": self.freeze_backbone_epochs,
        }

    def augment(self) -> Augment:
        """The training augmentations of image folders and shards (ValueError naming a bad one)."""
        return Augment(
            scale=(float(self.scale[0]), float(self.scale[1])), hflip=self.hflip, randaugment=self.randaugment,
            reprob=self.reprob, mixup=self.mixup, cutmix=self.cutmix,
        )  # fmt: skip

    def validate(self) -> None:
        """Raise ValueError / FileNotFoundError naming the bad setting, before anything is built."""
        if self.model not in list_models():
            create_model(self.model)  # raises the registry's error, with close matches
        for name in ("epochs", "batch_size", "eval_batch_size", "accum_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name.replace('_', ' ')} must be a positive int, got {value!r}")
        if "num_classes" in self.overrides:
            raise ValueError("num_classes is set from the data's classes; remove it from --set")
        if "keep_ratio" in self.overrides:
            check_keep_ratio(self.overrides["keep_ratio"])
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ValueError(f"clip grad must be positive (or None), got {self.clip_grad!r}")
        if not self.warmup_epochs >= 0:
            raise ValueError(f"warmup epochs must be >= 0, got {self.warmup_epochs!r}")
        check_data(self.data)
        if self.val_data is not None:
            check_data(self.val_data, "val_data")
        elif is_shard_pattern(self.data):
            raise ValueError(f"--data {self.data!r} is shards: give the evaluation shards or folder as --val-data")
        self.augment()
        if self.batch_size % self.accum_steps:
            raise ValueError(f"batch size {self.batch_size} is not divisible by accum steps {self.accum_steps}")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 0):
            raise ValueError(f"workers must be an int >= 0, got {self.workers!r}")
        if self.distill and self.teacher is None:  # DynamicViT's loss runs only beside a teacher
            raise ValueError(
                f"--distill {_as_set(self.distill)} sets DynamicViT's distillation from a teacher, and no --teacher "
                "was given: add --teacher with the dense checkpoint, or drop --distill"
            )
        if self.teacher is not None:
            if not self.model.startswith("dynamicvit_") and self.overrides.get("reducer") != "dynamicvit":
                raise ValueError(
                    f"--teacher needs a dynamicvit_* model (or --set reducer=dynamicvit on any ViT), got {self.model!r}"
                )
            if not Path(self.teacher).is_file():
                raise FileNotFoundError(f"teacher checkpoint {self.teacher!r} does not exist")

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every field's default, by name (fields without one are left out)."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    def run_record(self) -> dict[str, Any]:
        """The settings as plain JSON-able values (stored with the checkpoints)."""
        return dataclasses.asdict(self)


def _as_set(values: dict[str, Any]) -> str:
    """``{"a": 1, "b": 2}`` -> ``a=1,b=2`` (options as the command line gave them)."""
    return ",".join(f"{key}={value}" for key, value in values.items())
