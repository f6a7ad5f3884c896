"""Decoding one picture file: the one place vitrim turns a PNG/JPEG into the tensor a model sees.

Images are converted to the model's channels (``L`` for 1, ``RGB`` for 3), resized to its (H, W) with bilinear
filtering and normalised with mean 0.5 and std 0.5 to [−1, 1], as the image folders of ``vitrim train`` are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vitrim.data.digits import MEAN, STD  # the digits' normalisation: [0, 1] -> [-1, 1]
from vitrim.data.image_file import ImageRefused, open_image


def decode_image(path: str | Path, size: tuple[int, int], in_chans: int) -> np.ndarray:
    """Decode one file to (in_chans, H, W) uint8; raises ValueError over the pixel limit
    (:mod:`vitrim.data.image_file`), whatever Pillow raises on a bad file."""
    from PIL import Image  # Pillow is optional (the viz and train extras): imported when a file is decoded

    if in_chans not in (1, 3):
        raise ValueError(f"images can be read for models with 1 or 3 input channels, not in_chans={in_chans}")
    img = open_image(path, "L" if in_chans == 1 else "RGB").resize((size[1], size[0]), Image.Resampling.BILINEAR)
    array = np.asarray(img, dtype=np.uint8)
    return array[None] if in_chans == 1 else array.transpose(2, 0, 1)


def check_image_path(path: str | Path, name: str) -> None:
    """FileNotFoundError when ``path`` does not exist, ValueError when it is not a regular file (a FIFO, a folder)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{name} {str(path)!r} does not exist")
    if not Path(path).is_file():
        raise ValueError(f"{name} {str(path)!r} is not a regular file (expected a PNG/JPEG image)")


def unreadable_image(path: str | Path, name: str, err: BaseException) -> ValueError:
    """The one-line error for a file that could not be decoded: over the pixel limit, or Pillow's failure."""
    detail = (str(err).splitlines()[0] if str(err) else "") or type(err).__name__
    if isinstance(err, ImageRefused):
        return ValueError(f"{name} {str(path)!r}: {detail}")
    return ValueError(f"{name} {str(path)!r} is not a readable PNG/JPEG image ({detail})")


def normalise(pixels: Tensor, mean: tuple[float, ...] | float = MEAN, std: tuple[float, ...] | float = STD) -> Tensor:
    """uint8 pixels (…, C, H, W) -> float32 (pixels / 255 − mean) / std, per channel; default: [−1, 1]."""
    shape = (-1, 1, 1)
    m = torch.tensor(mean, dtype=torch.float32).reshape(shape) if isinstance(mean, tuple) else mean
    s = torch.tensor(std, dtype=torch.float32).reshape(shape) if isinstance(std, tuple) else std
    return pixels.float().div_(255.0).sub_(m).div_(s)


def read_image(
    path: str | Path,
    size: tuple[int, int],
    in_chans: int,
    mean: tuple[float, ...] | float = MEAN,
    std: tuple[float, ...] | float = STD,
    *,
    name: str = "image",
) -> Tensor:
    """A PNG/JPEG file -> (in_chans, H, W) float32 normalised with ``mean``/``std`` (a model's ``data_config``;
    default: vitrim's [−1, 1]); ``size`` is (H, W).

    A missing file is a FileNotFoundError and an unreadable one a ValueError, both naming the file as ``name``
    (the command line passes its option, ``--image``).
    """
    if in_chans not in (1, 3):
        raise ValueError(f"images can be read for models with 1 or 3 input channels, not in_chans={in_chans}")
    check_image_path(path, name)
    try:
        pixels = decode_image(path, size, in_chans)
    except Exception as err:  # Pillow raises many kinds on a bad file
        raise unreadable_image(path, name, err) from None
    return normalise(torch.from_numpy(pixels.copy()), mean, std)
