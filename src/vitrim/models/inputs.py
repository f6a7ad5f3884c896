"""The one check of an image batch at a model's entry: type, rank, channels, size, dtype and device.

Every registered model calls it before its first layer runs, so a wrong batch gets an error that names what is
wrong (``images have dtype torch.float64, but the model's weights are torch.float32; …``) instead of a traceback
from inside a convolution. Images are never converted silently: uint8 pixels need the model's normalisation
(``vitrim.data``), which a model cannot guess.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_images(images: object, *, in_chans: int, weight: Tensor, patch_size: int = 1) -> tuple[int, int]:
    """Raise a clear TypeError/ValueError for a wrong batch; return (H // patch_size, W // patch_size).

    Args:
        images: what the caller passed; a (B, C, H, W) floating tensor is expected.
        in_chans: C the model was built for.
        weight: the first layer's weight: the dtype and device the images must have (under autocast, any dtype
            autocast casts: float32, float16, bfloat16; float64 is never cast).
        patch_size: H and W must be positive multiples of it.
    """
    if not isinstance(images, Tensor):
        raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.dim() != 4:
        raise ValueError(f"images must have shape (B, C, H, W), got {tuple(images.shape)}")
    if images.shape[1] != in_chans:
        raise ValueError(f"images have {images.shape[1]} channels, but the model expects in_chans={in_chans}")
    for name, size in (("height", images.shape[2]), ("width", images.shape[3])):
        if size % patch_size != 0 or size == 0:
            what = f"is not divisible by patch size {patch_size}" if patch_size > 1 else "must be positive"
            raise ValueError(f"image {name} {size} {what}")
    if images.shape[0] == 0:
        raise ValueError(f"images must hold at least one image, got shape {tuple(images.shape)}")
    if not images.is_floating_point():
        raise TypeError(
            f"images must be floating point, got dtype {images.dtype}; convert pixels with images.float() and "
            "normalise them as the model was trained (mean/std, see vitrim.data)"
        )
    if images.device != weight.device:
        raise ValueError(f"images are on {images.device}, but the model is on {weight.device}; move one of them")
    autocast = torch.is_autocast_enabled(images.device.type) and images.dtype != torch.float64
    if images.dtype != weight.dtype and not autocast:
        raise TypeError(
            f"images have dtype {images.dtype}, but the model's weights are {weight.dtype}; "
            f"pass images.to({weight.dtype}) or run under torch.autocast"
        )
    return images.shape[2] // patch_size, images.shape[3] // patch_size
