"""The DeiT recipe's training augmentations (Touvron et al., 2021; timm's ``train.py`` flags), each switchable.

Per image, in a DataLoader worker (:func:`train_transform`, PIL image -> normalised tensor):

    RandomResizedCrop(size, scale, ratio 3/4-4/3, the model's interpolation)    timm: --scale 0.08 1
    RandomHorizontalFlip(hflip)                                                 timm: --hflip 0.5
    RandAugment(2 ops, magnitude)                                               timm: --aa rand-m9-mstd0.5-inc1
    to float in [0, 1], Normalize(the model's mean, std)
    RandomErasing(reprob, one box, per-pixel normal values)                     timm: --reprob 0.25 --remode pixel

Per batch, on the device (:class:`MixupCutmix`): mixup (Beta(α, α), α = 0.8) or cutmix (α = 1.0, λ corrected to the
pasted box's area), one of the two per batch with probability 1/2 each and one λ per batch, images paired with the
batch rolled by one; the targets become λ·y_i + (1 − λ)·y_j of label-smoothed one-hot rows (timm's ``Mixup`` with
``label_smoothing``: smoothing then mixing, which is the same as mixing then smoothing).

All of it is torchvision's transforms v2. torchvision's RandAugment samples 2 of its 14 operations with a fixed
magnitude; timm's ``rand-m9-mstd0.5-inc1`` adds Gaussian noise (std 0.5) to the magnitude and scales some operations
by it ("inc"): close, not identical (docs/data.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vitrim.data.vision import transforms_v2
from vitrim.models.data_config import DataConfig

_INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


@dataclass(frozen=True)
class Augment:
    """Which augmentations training uses; the defaults are the DeiT recipe's. A value of 0 turns one off."""

    scale: tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop's area range; (1, 1) with ratio 1 is a resize
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # RandomResizedCrop's aspect range
    hflip: float = 0.5  # probability of a horizontal flip
    randaugment: int = 9  # RandAugment magnitude (0-30; 0: no RandAugment)
    reprob: float = 0.25  # probability of random erasing
    mixup: float = 0.8  # mixup's Beta α (0: no mixup)
    cutmix: float = 1.0  # cutmix's Beta α (0: no cutmix)

    def __post_init__(self) -> None:
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"scale must be (min, max) with 0 < min <= max <= 1, got {self.scale!r}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must be (min, max) with 0 < min <= max, got {self.ratio!r}")
        for name in ("hflip", "reprob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be a probability in [0, 1], got {getattr(self, name)!r}")
        if isinstance(self.randaugment, bool) or not isinstance(self.randaugment, int) or not self.randaugment >= 0:
            raise ValueError(f"randaugment must be a magnitude int in [0, 30], got {self.randaugment!r}")
        if self.randaugment > 30:
            raise ValueError(f"randaugment must be a magnitude int in [0, 30], got {self.randaugment!r}")
        for name in ("mixup", "cutmix"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be a Beta α >= 0 (0 turns it off), got {getattr(self, name)!r}")

    @classmethod
    def none(cls) -> Augment:
        """No augmentation at all: a resize of the whole image to the model's size, no flip, no mixing."""
        return cls(scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0.0, randaugment=0, reprob=0.0, mixup=0.0, cutmix=0.0)

    def replace(self, **changes: Any) -> Augment:
        return dataclasses.replace(self, **changes)


def interpolation_mode(name: str) -> Any:
    """torchvision's InterpolationMode for a data config's ``interpolation`` name."""
    if name not in _INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {_INTERPOLATIONS}, got {name!r}")
    return transforms_v2().InterpolationMode(name)


def train_transform(data_config: DataConfig, augment: Augment) -> Callable[[Any], Tensor]:
    """PIL image -> (C, H, W) float32 tensor, augmented as ``augment`` says and normalised as the model expects."""
    v2 = transforms_v2()
    _, height, width = data_config.input_size
    interpolation = interpolation_mode(data_config.interpolation)
    steps: list[Any] = [
        v2.RandomResizedCrop((height, width), scale=augment.scale, ratio=augment.ratio, interpolation=interpolation)
    ]
    if augment.hflip > 0:
        steps.append(v2.RandomHorizontalFlip(augment.hflip))
    if augment.randaugment > 0:
        steps.append(v2.RandAugment(num_ops=2, magnitude=augment.randaugment, interpolation=interpolation))
    steps += [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(data_config.mean, data_config.std)]
    if augment.reprob > 0:
        steps.append(v2.RandomErasing(augment.reprob, scale=(0.02, 1 / 3), ratio=(0.3, 3.3), value="random"))
    return v2.Compose(steps)


class MixupCutmix:
    """``(images (B, C, H, W), labels (B,)) -> (mixed images, soft targets (B, K))`` (module doc); torchvision's."""

    def __init__(self, num_classes: int, *, mixup: float, cutmix: float, label_smoothing: float = 0.0) -> None:
        if not (mixup > 0 or cutmix > 0):
            raise ValueError(f"MixupCutmix needs mixup > 0 or cutmix > 0, got mixup={mixup!r}, cutmix={cutmix!r}")
        v2 = transforms_v2()
        choices = [v2.MixUp(alpha=mixup, num_classes=num_classes)] if mixup > 0 else []
        choices += [v2.CutMix(alpha=cutmix, num_classes=num_classes)] if cutmix > 0 else []
        self.mix = v2.RandomChoice(choices)
        self.num_classes = num_classes
        self.label_smoothing = float(label_smoothing)

    def __call__(self, images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        images, targets = self.mix(images, labels)  # targets (B, K): λ·onehot(y) + (1 − λ)·onehot(y rolled)
        smoothed = targets * (1 - self.label_smoothing) + self.label_smoothing / self.num_classes  # (B, K)
        return images, smoothed
