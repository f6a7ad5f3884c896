"""How a model wants its images: size, normalisation, resize and crop, as timm's ``pretrained_cfg`` says it.

Every registered model carries one (``model.data_config``): the input size follows the model's own ``img_size``
and ``in_chans``; mean, std, interpolation and crop are those its weights were trained with (timm's default tag).
The field names are timm's data-config keys, so ``timm.data.create_transform(**dataclasses.asdict(config))`` and
:func:`vitrim.data.eval_transform` read the same thing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
INCEPTION_MEAN, INCEPTION_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")  # timm's (Pillow's filters)
CROP_MODES = ("center", "squash", "border")
# Pillow's resampling filters by number, as transformers' preprocessor_config.json stores them ("resample": 3)
PIL_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


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

    @classmethod
    def from_timm(cls, pretrained_cfg: dict[str, Any]) -> DataConfig:
        """timm's ``pretrained_cfg`` (a model's, or the one in a hub repo's config.json) -> its data config; keys it
        lacks keep timm's defaults (``resolve_data_config``: 224, ImageNet mean/std, bicubic, 0.875, centre)."""
        if not isinstance(pretrained_cfg, dict):
            raise TypeError(f"pretrained_cfg must be a dict, got {type(pretrained_cfg).__name__}")
        c = pretrained_cfg
        return cls(
            input_size=tuple(c.get("input_size") or (3, 224, 224)),
            mean=tuple(c.get("mean") or IMAGENET_MEAN),
            std=tuple(c.get("std") or IMAGENET_STD),
            interpolation=c.get("interpolation") or "bicubic",
            crop_pct=c.get("crop_pct") or 0.875,
            crop_mode=c.get("crop_mode") or "center",
        )

    @classmethod
    def from_transformers(cls, processor: dict[str, Any], in_chans: int = 3) -> DataConfig:
        """transformers' ``preprocessor_config.json`` (an image processor's ``to_dict()``) -> the same preprocessing
        in timm's terms: ``image_mean`` / ``image_std``; ``resample`` (Pillow's number) -> interpolation; a resize of
        the shortest edge to S then a centre crop of C -> crop_mode "center", crop_pct C / S; a resize to (H, W)
        -> "squash" (then crop_pct C / H with a centre crop). An int ``size`` is the shortest edge when the
        processor crops (CLIP, DINOv2's BitImageProcessor), else the side of a square (ViT)."""
        if not isinstance(processor, dict):
            raise TypeError(f"processor config must be a dict, got {type(processor).__name__}")
        crop = processor.get("do_center_crop", False) and processor.get("crop_size") is not None
        size = processor.get("size", 224)
        if isinstance(size, int):
            size = {"shortest_edge": size} if crop else {"height": size, "width": size}
        try:
            if "shortest_edge" in size:
                resized, mode = (int(size["shortest_edge"]),) * 2, "center"
            else:
                resized, mode = (int(size["height"]), int(size["width"])), "squash"
            cropped = _height_width(processor["crop_size"]) if crop else resized
        except (KeyError, TypeError) as err:
            raise ValueError(f"preprocessor config has size {size!r} / crop_size vitrim cannot read ({err})") from None
        resample = processor.get("resample", 3)
        if resample not in PIL_FILTERS:
            raise ValueError(f"preprocessor config has resample {resample!r}; expected one of {sorted(PIL_FILTERS)}")
        normalise = processor.get("do_normalize", True)
        mean = tuple(processor.get("image_mean") or IMAGENET_MEAN) if normalise else (0.0,) * in_chans
        std = tuple(processor.get("image_std") or IMAGENET_STD) if normalise else (1.0,) * in_chans
        return cls(
            input_size=(len(mean), *cropped),
            mean=mean,
            std=std,
            interpolation=PIL_FILTERS[resample],
            crop_pct=_crop_pct(min(cropped), min(resized)),
            crop_mode=mode,
        )


def _height_width(size: int | dict[str, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size["height"]), int(size["width"]))


def _crop_pct(crop: int, resized: int) -> float:
    """crop / resized, nudged down where float division would make timm's ``floor(crop / crop_pct)`` one short."""
    pct = crop / resized
    while math.floor(crop / pct) < resized:
        pct = math.nextafter(pct, 0.0)
    return pct


VIT = DataConfig()  # timm's ViT default: Inception mean/std 0.5
DEIT = DataConfig(mean=IMAGENET_MEAN, std=IMAGENET_STD)
DINOV2 = DataConfig(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=1.0)
CLIP = DataConfig(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, crop_pct=0.95)
SIGLIP = DataConfig()
EVA02 = DataConfig(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)
GAP = DataConfig(crop_pct=0.95)

# What the official transformers checkpoints' preprocessor_config.json say, per model type (for a model in memory,
# whose image processor is not at hand): google/vit-*, facebook/dinov2-*, openai/clip-vit-*, google/siglip-*
TRANSFORMERS_VIT = DataConfig(interpolation="bilinear", crop_pct=1.0, crop_mode="squash")
TRANSFORMERS_DINOV2 = DataConfig(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=0.875)
TRANSFORMERS_CLIP = DataConfig(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, crop_pct=1.0)
TRANSFORMERS_SIGLIP = DataConfig(crop_pct=1.0, crop_mode="squash")
