"""How a model wants its images: size, normalisation, resize and crop, as timm's ``pretrained_cfg`` says it.

Every registered model carries one (``model.data_config``): the input size follows the model's own ``img_size``
and ``in_chans``; mean, std, interpolation and crop are those its weights were trained with (timm's default tag).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
INCEPTION_MEAN, INCEPTION_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class DataConfig:
    """input_size (C, H, W); mean and std per channel (pixels in [0, 1]); interpolation of the resize; crop_pct:
    the resize is to size / crop_pct before a centre crop of ``size`` (1.0: no crop)."""

    input_size: tuple[int, int, int] = (3, 224, 224)
    mean: tuple[float, ...] = INCEPTION_MEAN
    std: tuple[float, ...] = INCEPTION_STD
    interpolation: str = "bicubic"
    crop_pct: float = 0.9

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
