"""A number drawn from an image's own pixels, so a seeded method selects the same tokens for an image alone or in a
batch, in transformers and in vLLM."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def content_seed(values: Tensor) -> int:
    """A number drawn from a tensor's bytes (blake2b of its CPU copy, 63 bits): the same for the same values
    wherever they sit in a batch."""
    data = values.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # any dtype (bf16)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def image_seeds(images: list[Tensor] | Tensor) -> Tensor:
    """(I,) long: :func:`content_seed` of each image's pixels (the rows of a batch, or one tensor per image)."""
    return torch.tensor([content_seed(image) for image in images], dtype=torch.long)
