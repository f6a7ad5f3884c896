"""The tests' checkpoint folders (vitrim.vlm_user.tiny) and a random picture."""

from __future__ import annotations

from pathlib import Path

import torch

from vitrim.vlm_user.tiny import save_gemma3, save_llava, save_llava_next, save_paligemma, save_qwen2_5_vl

__all__ = ["save_gemma3", "save_llava", "save_llava_next", "save_paligemma", "save_picture", "save_qwen2_5_vl"]


def save_picture(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """A random RGB PNG of ``width`` × ``height``."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path
