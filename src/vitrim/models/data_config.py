"""How a model wants its images: size, normalisation, resize and crop, as timm's ``pretrained_cfg`` says it.

Every registered model carries one (``model.data_config``): the input size follows the model's own ``img_size``
and ``in_chans``; mean, std, interpolation and crop are those its weights were trained with (timm's default tag).
The field names are timm's data-config keys, so ``timm.data.create_transform(**dataclasses.asdict(config))`` and
:func:`vitrim.data.eval_transform` read the same thing.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
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
# what a data config (a model's, a hub repo's preprocessor_config.json, a run.json) may ask for, checked before any
# image is resized: a crop_pct of 1e-5 would resize every image to 22 million pixels a side. The largest ViT inputs
# in use are 518 (DINOv2) to 1024 (SAM); raise this module attribute for more.
MAX_IMAGE_SIDE = 8192
MAX_CHANNELS = 16


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        size = self.input_size
        if not (isinstance(size, (tuple, list)) and len(size) == 3 and all(_is_int(v) and v > 0 for v in size)):
            raise ValueError(f"input_size must be three positive ints (C, H, W), got {_short(size)}")
        size = (int(size[0]), int(size[1]), int(size[2]))
        if size[0] > MAX_CHANNELS or max(size[1:]) > MAX_IMAGE_SIDE:
            raise ValueError(
                f"input_size {size} is over the limits of {MAX_CHANNELS} channels and {MAX_IMAGE_SIDE} pixels a side "
                "(vitrim.models.data_config.MAX_IMAGE_SIDE)"
            )
        object.__setattr__(self, "input_size", size)
        for name in ("mean", "std"):
            given = getattr(self, name)
            if not (isinstance(given, (tuple, list)) and all(_is_number(v) and math.isfinite(v) for v in given)):
                raise ValueError(f"{name} must be a list of finite numbers, one per channel, got {_short(given)}")
            values = tuple(float(v) for v in given)
            if len(values) != size[0]:
                raise ValueError(
                    f"{name} {values} has {len(values)} value(s); input_size {size} has {size[0]} channels"
                )
            object.__setattr__(self, name, values)
        if not all(v > 0 for v in self.std):
            raise ValueError(f"std must be positive (pixels are divided by it), got {self.std}")
        _check_float32_normalisation(self.mean, self.std)
        if not isinstance(self.interpolation, str) or self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {_short(self.interpolation)}")
        crop_pct = self.crop_pct
        if not (_is_number(crop_pct) and math.isfinite(crop_pct) and crop_pct > 0):
            raise ValueError(
                f"crop_pct must be a positive number (the crop's share of the resize), got {_short(crop_pct)}"
            )
        # checked before flooring: a subnormal crop_pct makes a side infinite, which no int holds
        resized = (size[1] / crop_pct, size[2] / crop_pct)
        if not all(1 <= side < MAX_IMAGE_SIDE + 1 for side in resized):
            shown = "x".join(str(math.floor(side)) if math.isfinite(side) else "inf" for side in resized)
            raise ValueError(
                f"crop_pct {crop_pct!r} resizes images of input_size {size} to {shown} before the crop; expected "
                f"sides from 1 to {MAX_IMAGE_SIDE} (vitrim.models.data_config.MAX_IMAGE_SIDE)"
            )
        object.__setattr__(self, "crop_pct", float(crop_pct))
        if not isinstance(self.crop_mode, str) or self.crop_mode not in CROP_MODES:
            raise ValueError(f"crop_mode must be one of {CROP_MODES}, got {_short(self.crop_mode)}")

    def for_input(self, in_chans: int, img_size: tuple[int, int]) -> DataConfig:
        """This config for a model built with another ``in_chans`` / ``img_size`` (a grey model averages mean/std)."""
        mean, std = self.mean, self.std
        if in_chans != len(mean):
            mean = (sum(mean) / len(mean),) * in_chans
            std = (sum(std) / len(std),) * in_chans
        return dataclasses.replace(self, input_size=(in_chans, *img_size), mean=mean, std=std)

    @classmethod
    def from_record(cls, fields: Any, source: str) -> DataConfig:
        """A data config as a file recorded it (``run.json``'s ``data_config``: this class's fields, lists for
        tuples); one ValueError naming ``source`` for anything else."""
        if not isinstance(fields, dict):
            raise ValueError(f"{source} must be an object of data-config fields, got {_short(fields)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in fields if k not in known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}; expected some of {sorted(known)}")
        try:
            return cls(**fields)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def from_timm(cls, pretrained_cfg: dict[str, Any]) -> DataConfig:
        """timm's ``pretrained_cfg`` (a model's, or the one in a hub repo's config.json) -> its data config; keys it
        lacks keep timm's defaults (``resolve_data_config``: 224, ImageNet mean/std, bicubic, 0.875, centre)."""
        if not isinstance(pretrained_cfg, dict):
            raise TypeError(f"pretrained_cfg must be a dict, got {type(pretrained_cfg).__name__}")
        c = pretrained_cfg
        try:
            return cls(
                input_size=c.get("input_size") or (3, 224, 224),
                mean=c.get("mean") or IMAGENET_MEAN,
                std=c.get("std") or IMAGENET_STD,
                interpolation=c.get("interpolation") or "bicubic",
                crop_pct=c.get("crop_pct") or 0.875,
                crop_mode=c.get("crop_mode") or "center",
            )
        except ValueError as err:
            raise ValueError(f"pretrained_cfg: {err}") from None

    @classmethod
    def from_transformers(cls, processor: dict[str, Any], in_chans: int = 3) -> DataConfig:
        """transformers' ``preprocessor_config.json`` (an image processor's ``to_dict()``) -> the same preprocessing
        in timm's terms: ``image_mean`` / ``image_std``; ``resample`` (Pillow's number) -> interpolation; a resize of
        the shortest edge to S then a centre crop of C -> crop_mode "center", crop_pct C / S; a resize to (H, W)
        -> "squash" (then crop_pct C / H with a centre crop). An int ``size`` is the shortest edge when the
        processor crops (CLIP, DINOv2's BitImageProcessor), else the side of a square (ViT)."""
        if not isinstance(processor, dict):
            raise TypeError(f"processor config must be a dict, got {type(processor).__name__}")
        crop = processor.get("do_center_crop", False) is True and processor.get("crop_size") is not None
        size = processor.get("size", 224)
        if _is_int(size):
            size = {"shortest_edge": size} if crop else {"height": size, "width": size}
        if not isinstance(size, dict) or not ("shortest_edge" in size or {"height", "width"} <= set(size)):
            raise ValueError(
                f"{PROCESSOR}: 'size' must be an int or an object with 'shortest_edge' or 'height' and 'width', "
                f"got {_short(size)}"
            )
        if "shortest_edge" in size:
            resized, mode = (_side(size["shortest_edge"], "size['shortest_edge']"),) * 2, "center"
        else:
            resized = (_side(size["height"], "size['height']"), _side(size["width"], "size['width']"))
            mode = "squash"
        cropped = _height_width(processor["crop_size"]) if crop else resized
        resample = processor.get("resample", 3)
        if not _is_int(resample) or resample not in PIL_FILTERS:
            raise ValueError(f"{PROCESSOR}: 'resample' must be one of {sorted(PIL_FILTERS)}, got {_short(resample)}")
        normalise = processor.get("do_normalize", True) is not False
        mean = processor.get("image_mean") or IMAGENET_MEAN if normalise else (0.0,) * in_chans
        std = processor.get("image_std") or IMAGENET_STD if normalise else (1.0,) * in_chans
        for name, values in (("image_mean", mean), ("image_std", std)):
            finite = isinstance(values, (list, tuple)) and all(_is_number(v) and math.isfinite(v) for v in values)
            if not (finite and 1 <= len(values) <= MAX_CHANNELS) or (name == "image_std" and min(values) <= 0):
                positive = " (all > 0: pixels are divided by them)" if name == "image_std" else ""
                raise ValueError(
                    f"{PROCESSOR}: {name!r} must be a list of finite numbers, one per channel{positive}, "
                    f"got {_short(values)}"
                )
        try:
            return cls(
                input_size=(len(mean), *cropped),
                mean=tuple(mean),
                std=tuple(std),
                interpolation=PIL_FILTERS[resample],
                crop_pct=_crop_pct(min(cropped), min(resized)),
                crop_mode=mode,
            )
        except ValueError as err:
            raise ValueError(f"{PROCESSOR}: {err}") from None


PROCESSOR = "preprocessor_config.json"


def _check_float32_normalisation(means: tuple[float, ...], stds: tuple[float, ...]) -> None:
    """Images are normalised in float32, ``(pixel - mean) / std`` for pixels in [0, 1]: each channel's mean and std
    must be finite float32 numbers (a std of 1e-50 is 0 there), and the darkest and brightest pixels must stay finite
    (a mean of 1e308 is not). Checked by computing it as the transform does."""
    import torch

    cpu = torch.device("cpu")  # a config is also made while a model is built on the meta device: compute here
    pixels = torch.tensor([0.0, 1.0], device=cpu)
    for channel, (mean, std) in enumerate(zip(means, stds)):
        mean32 = torch.tensor(mean, dtype=torch.float32, device=cpu)
        std32 = torch.tensor(std, dtype=torch.float32, device=cpu)
        if not (torch.isfinite(mean32) and torch.isfinite(std32) and std32 > 0):
            raise ValueError(
                f"mean {mean!r} and std {std!r} (channel {channel}) are {mean32.item()!r} and {std32.item()!r} in "
                "float32, which images are normalised in; expected finite numbers and a std above 0"
            )
        normalised = (pixels - mean32) / std32
        if not torch.isfinite(normalised).all():
            raise ValueError(
                f"mean {mean!r} and std {std!r} (channel {channel}) make normalised pixels overflow float32 "
                f"((pixel - mean) / std for pixels 0 and 1 is {normalised.tolist()})"
            )


def _side(value: Any, field: str) -> int:
    """An image side a preprocessor config gives: an int from 1 to MAX_IMAGE_SIDE, else the error naming ``field``."""
    if not (_is_int(value) and 1 <= value <= MAX_IMAGE_SIDE):
        raise ValueError(
            f"{PROCESSOR}: {field} must be an int from 1 to {MAX_IMAGE_SIDE} "
            f"(vitrim.models.data_config.MAX_IMAGE_SIDE), got {_short(value)}"
        )
    return int(value)


def _height_width(size: Any) -> tuple[int, int]:
    """``crop_size``: an int (a square) or ``{"height", "width"}``."""
    if _is_int(size):
        return _side(size, "crop_size"), _side(size, "crop_size")
    if not (isinstance(size, dict) and {"height", "width"} <= set(size)):
        raise ValueError(
            f"{PROCESSOR}: 'crop_size' must be an int or an object with 'height' and 'width', got {_short(size)}"
        )
    return _side(size["height"], "crop_size['height']"), _side(size["width"], "crop_size['width']")


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
