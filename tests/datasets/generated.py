"""Datasets the tests generate on disk: ImageNet-layout folders and WebDataset shards of tiny images.

Each image is one solid colour that encodes its sample id (red = id % 256, green = id // 256, blue = its class × 40),
so a test can tell which sample reached a batch after any resize: decode with :func:`sample_ids`.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from PIL import Image

from vitrim.models.data_config import DataConfig

# mean 0, std 1 and no crop: a solid image comes out as its colour / 255, so ids survive the eval transform
IDENTITY_PIXELS = DataConfig(input_size=(3, 8, 8), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), crop_pct=1.0)


def colour(sample_id: int, label: int) -> tuple[int, int, int]:
    return sample_id % 256, sample_id // 256, 40 * label


def png_bytes(sample_id: int, label: int, size: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour(sample_id, label)).save(buffer, format="PNG")
    return buffer.getvalue()


def sample_ids(images: torch.Tensor) -> list[int]:
    """Ids of a batch (B, 3, H, W) of solid images read with :data:`IDENTITY_PIXELS`."""
    rgb = (images.mean(dim=(2, 3)) * 255).round().long()  # (B, 3)
    return (rgb[:, 0] + 256 * rgb[:, 1]).tolist()


def write_folder(root: Path, per_class: list[int], *, first_id: int = 0) -> int:
    """``root/<class k>/<id>.png`` with ``per_class[k]`` images each; returns the next free id."""
    sample_id = first_id
    for label, count in enumerate(per_class):
        folder = root / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        for _ in range(count):
            (folder / f"{sample_id:06d}.png").write_bytes(png_bytes(sample_id, label))
            sample_id += 1
    return sample_id


def write_shards(folder: Path, name: str, shard_sizes: list[int], num_classes: int, *, first_id: int = 0) -> str:
    """Tar shards ``name-000000.tar`` … of ``shard_sizes`` samples (label = id % num_classes) and ``_info.json``;
    returns the brace pattern."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    sample_id = first_id
    for index, size in enumerate(shard_sizes):
        with wds.TarWriter(str(folder / f"{name}-{index:06d}.tar")) as writer:
            for _ in range(size):
                label = sample_id % num_classes
                writer.write({"__key__": f"{sample_id:08d}", "png": png_bytes(sample_id, label), "cls": str(label)})
                sample_id += 1
    (folder / "_info.json").write_text(json.dumps({"classes": [f"class_{k}" for k in range(num_classes)]}))
    return str(folder / f"{name}-{{{0:06d}..{len(shard_sizes) - 1:06d}}}.tar")
