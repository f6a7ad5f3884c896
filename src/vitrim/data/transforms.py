"""A model's own preprocessing: ``eval_transform(model.data_config)`` maps a PIL image to the tensor it expects.

The pipeline is timm's evaluation transform (``timm.data.create_transform(**data_config, is_training=False)``),
step for step and on the same torchvision transforms, so the pixels equal timm's (tested to 1e-6):

* ``crop_mode="center"``: resize the shorter side to ``size / crop_pct`` (a non-square size: the side that
  overflows least), keeping the aspect ratio, then a centre crop of ``size``;
* ``"squash"``: resize each side to ``size / crop_pct``, aspect ratio ignored, then a centre crop;
* ``"border"``: resize the longer side to ``size / crop_pct``, then pad with the mean colour to ``size`` (and
  crop what still overflows);
* then ``ToTensor`` (pixels in [0, 1], (C, H, W) float32) and ``Normalize(mean, std)``.

Sizes are floored as timm floors them (``floor(224 / 0.9) = 248``). One step precedes timm's: the image is
converted to the model's channels (``RGB`` for 3, ``L`` for 1), as timm's datasets do when they open a file, so a
grey or RGBA picture gives the tensor the model takes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import Tensor

from vitrim.data.image_file import PIXEL_LIMIT_VARIABLE, ImageRefused, open_image, pixel_limit
from vitrim.data.images import check_image_path, unreadable_image
from vitrim.data.vision import transforms_v1
from vitrim.extras import require
from vitrim.models.data_config import DataConfig


class ToMode:
    """PIL image -> the same image in Pillow mode ``mode`` ("RGB" or "L"); a no-op when it already is."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, image: Any) -> Any:
        return image if image.mode == self.mode else image.convert(self.mode)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mode!r})"


class ResizeGuard:
    """Refuse (:class:`~vitrim.data.image_file.ImageRefused`) an image the resize would blow up past the pixel limit.

    A 20000×1 picture passes the decoder's limit (20,000 pixels), but a shorter side resized to 224 makes it
    4,480,000×224: the aspect ratio is a decompression bomb of its own. ``scale_size`` (H, W) is the resize target;
    ``keep_ratio`` False means each side is resized to it ("squash"), which cannot grow past it.
    """

    def __init__(self, scale_size: tuple[int, int], keep_ratio: bool, *, fit: bool = False) -> None:
        self.scale_size, self.keep_ratio, self.fit = scale_size, keep_ratio, fit

    def __call__(self, image: Any) -> Any:
        width, height = image.size
        if not self.keep_ratio:
            return image
        # the covering resize (the larger scale), or with ``fit`` ("border") the one that fits inside: the smaller
        scale = (min if self.fit else max)(self.scale_size[0] / height, self.scale_size[1] / width)
        limit = pixel_limit()
        if limit is not None and height * width * scale * scale > limit:
            raise ImageRefused(
                f"image of {width}x{height} pixels would be resized to about {round(width * scale)}x"
                f"{round(height * scale)}, over the limit of {limit} pixels (its aspect ratio is too extreme; raise "
                f"the limit with {PIXEL_LIMIT_VARIABLE}=N or PIL.Image.MAX_IMAGE_PIXELS)"
            )
        return image

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale_size={self.scale_size})"


class ResizeKeepRatio:
    """Resize to fit ``size`` (H, W) keeping the aspect ratio: the ratio is the smaller of the two side ratios
    (``longest=False``: the image covers ``size``) or the larger (``longest=True``: the image fits inside it);
    each side is ``round(side / ratio)``, as timm's ``ResizeKeepRatio`` computes it."""

    def __init__(self, size: tuple[int, int], interpolation: Any, longest: bool) -> None:
        self.size, self.interpolation, self.longest = size, interpolation, longest

    def __call__(self, image: Any) -> Any:
        functional = transforms_v1().functional
        _, height, width = functional.get_dimensions(image)
        ratios = (height / self.size[0], width / self.size[1])
        ratio = max(ratios) if self.longest else min(ratios)
        new_size = [max(1, round(height / ratio)), max(1, round(width / ratio))]  # a 2000x3 line stays 1 px high
        return functional.resize(image, new_size, interpolation=self.interpolation)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, longest={self.longest})"


class CenterCropOrPad:
    """Pad to at least ``size`` (H, W) with ``fill`` (the left/top pad takes the smaller half), then centre-crop to
    ``size``: timm's ``CenterCropOrPad`` (torchvision's own centre crop pads with black only)."""

    def __init__(self, size: tuple[int, int], fill: list[int]) -> None:
        self.size, self.fill = size, fill

    def __call__(self, image: Any) -> Any:
        functional = transforms_v1().functional
        _, height, width = functional.get_dimensions(image)
        pad_h, pad_w = max(self.size[0] - height, 0), max(self.size[1] - width, 0)
        if pad_h or pad_w:
            padding = [pad_w // 2, pad_h // 2, (pad_w + 1) // 2, (pad_h + 1) // 2]  # left, top, right, bottom
            image = functional.pad(image, padding, fill=self.fill)
        return functional.center_crop(image, list(self.size))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, fill={self.fill})"


def eval_transform(data_config: DataConfig) -> Any:
    """A callable: PIL image (any size, any mode) -> (C, H, W) float32 tensor, normalised, as timm's eval transform.

    ``data_config``: a model's ``data_config`` (:class:`~vitrim.models.data_config.DataConfig`); C, H, W are its
    ``input_size``. See the module doc for the steps of each ``crop_mode``.
    """
    if not isinstance(data_config, DataConfig):
        raise TypeError(
            f"data_config must be a vitrim DataConfig (model.data_config), got {type(data_config).__name__}"
        )
    transforms = transforms_v1()
    channels, height, width = data_config.input_size
    if channels not in (1, 3):
        raise ValueError(f"images can be read for 1 or 3 channels, but input_size is {data_config.input_size}")
    size = (height, width)
    scale_size = (math.floor(height / data_config.crop_pct), math.floor(width / data_config.crop_pct))
    interpolation = transforms.InterpolationMode(data_config.interpolation)
    steps: list[Any] = [
        ToMode("RGB" if channels == 3 else "L"),
        ResizeGuard(scale_size, data_config.crop_mode != "squash", fit=data_config.crop_mode == "border"),
    ]
    if data_config.crop_mode == "squash":
        steps += [transforms.Resize(scale_size, interpolation=interpolation), transforms.CenterCrop(size)]
    elif data_config.crop_mode == "border":
        fill = [round(255 * v) for v in data_config.mean]
        steps += [ResizeKeepRatio(scale_size, interpolation, longest=True), CenterCropOrPad(size, fill)]
    elif scale_size[0] == scale_size[1]:  # centre, square: torchvision's shorter-side resize (an int size)
        steps += [transforms.Resize(scale_size[0], interpolation=interpolation), transforms.CenterCrop(size)]
    else:
        steps += [ResizeKeepRatio(scale_size, interpolation, longest=False), transforms.CenterCrop(size)]
    steps += [transforms.ToTensor(), transforms.Normalize(mean=data_config.mean, std=data_config.std)]
    return transforms.Compose(steps)


def read_image_for(path: str | Path, data_config: DataConfig, *, name: str = "image") -> Tensor:
    """A PNG/JPEG file -> the (C, H, W) tensor a model with ``data_config`` takes (:func:`eval_transform`).

    A missing file is a FileNotFoundError and an unreadable one a ValueError, both naming the file as ``name``.
    """
    transform = eval_transform(data_config)
    require("PIL", feature="reading an image")
    check_image_path(path, name)
    try:
        image = open_image(path, "RGB" if data_config.input_size[0] == 3 else "L")
    except Exception as err:  # Pillow raises many kinds on a bad file
        raise unreadable_image(path, name, err) from None
    try:
        return transform(image)
    except ImageRefused as err:
        raise unreadable_image(path, name, err) from None
