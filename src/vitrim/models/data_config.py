"""How a model wants its images: size, normalisation, resize and crop, as timm's ``pretrained_cfg`` says it.

Every registered model carries one (``model.data_config``): the input size follows the model's own ``img_size``
and ``in_chans``; mean, std, interpolation and crop are those its weights were trained with (timm's default tag).
The field names are timm's data-config keys, so ``timm.data.create_transform(**dataclasses.asdict(config))`` and
:func:`vitrim.data.eval_transform` read the same thing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
INCEPTION_MEAN, INCEPTION_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")  # timm's (Pillow's filters)
CROP_MODES = ("center", "squash", "border")


@dataclass(frozen=True)
class DataConfig:
    """input_size (C, H, W); mean and std per channel (pixels in [0, 1]); interpolation of the resize; crop_pct:
    the resize is to size / crop_pct before a crop of ``size`` (1.0: no crop); crop_mode, as timm's eval transform:
    "center" keeps the aspect ratio (shorter side to size / crop_pct, centre crop), "squash" resizes each side to
    size / crop_pct regardless of the aspect ratio, "border" fits the longer side and pads with the mean colour."""

    input_size: tuple[int, int, int] = (3, 224, 224)
    mean: tuple[float, ...] = INCEPTION_MEAN
    std: tuple[float, ...] = INCEPTION_STD
    interpolation: str = "bicubic"
    crop_pct: float = 0.9
    crop_mode: str = "center"

    def __post_init__(self) -> None:
        size = tuple(self.input_size)
        if len(size) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size):
            raise ValueError(f"input_size must be three positive ints (C, H, W), got {self.input_size!r}")
        object.__setattr__(self, "input_size", size)
        for name in ("mean", "std"):
            values = tuple(float(v) for v in getattr(self, name))
            if len(values) != size[0]:
                raise ValueError(
                    f"{name} {values} has {len(values)} value(s); input_size {size} has {size[0]} channels"
                )
            object.__setattr__(self, name, values)
        if not all(v > 0 for v in self.std):
            raise ValueError(f"std must be positive, got {self.std}")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")
        if not (isinstance(self.crop_pct, (int, float)) and self.crop_pct > 0):
            raise ValueError(
                f"crop_pct must be a positive number (the crop's share of the resize), got {self.crop_pct!r}"
            )
        object.__setattr__(self, "crop_pct", float(self.crop_pct))
        if self.crop_mode not in CROP_MODES:
            raise ValueError(f"crop_mode must be one of {CROP_MODES}, got {self.crop_mode!r}")

    def for_input(self, in_chans: int, img_size: tuple[int, int]) -> DataConfig:
        """This config for a model built with another ``in_chans`` / ``img_size`` (a grey model averages mean/std)."""
        mean, std = self.mean, self.std
        if in_chans != len(mean):
            mean = (sum(mean) / len(mean),) * in_chans
            std = (sum(std) / len(std),) * in_chans
        return dataclasses.replace(self, input_size=(in_chans, *img_size), mean=mean, std=std)


VIT = DataConfig()  # timm's ViT default: Inception mean/std 0.5
DEIT = DataConfig(mean=IMAGENET_MEAN, std=IMAGENET_STD)
DINOV2 = DataConfig(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=1.0)
CLIP = DataConfig(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, crop_pct=0.95)
SIGLIP = DataConfig()
EVA02 = DataConfig(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)
GAP = DataConfig(crop_pct=0.95)
