"""Stand-ins for the files a reader of the documentation would bring: the same names, formats and tensor shapes as
the real downloads, random weights. A page's blocks run in a folder holding the stand-ins the page names.

Each maker writes one file (or folder) into the folder it is given; :func:`standins_for` makes the ones a page
mentions, once per test session, and links them into the page's working folder.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import vitrim
from vitrim.shipped import copy_run_files, shipped_run


def _official_release(model_name: str) -> Callable[[Path], None]:
    """A ``.pth`` as DeiT and DynamicViT release theirs: ``{"model": state_dict}`` with timm's key names."""

    def make(path: Path) -> None:
        torch.manual_seed(0)
        torch.save({"model": vitrim.create_model(model_name).state_dict()}, path)

    return make


def _timm_weights(model_name: str, save: Callable[[dict, Path], None]) -> Callable[[Path], None]:
    """A bare state dict with timm's key names, as timm's hub files hold them."""

    def make(path: Path) -> None:
        torch.manual_seed(0)
        save(vitrim.create_model(model_name).state_dict(), path)

    return make


def _hf_folder(kind: str) -> Callable[[Path], None]:
    """A tiny ``save_pretrained`` folder of a transformers model: what a Hugging Face download unpacks to."""

    def make(path: Path) -> None:
        import transformers

        torch.manual_seed(0)
        sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32)
        if kind == "vit":
            model = transformers.ViTForImageClassification(transformers.ViTConfig(**sizes, patch_size=8, num_labels=10))
        else:
            model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**sizes, patch_size=8))
        model.save_pretrained(path)

    return make


def _image(path: Path) -> None:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, size=(240, 320, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def _demo_run(kind: str) -> Callable[[Path], None]:
    """What ``make demo`` leaves in runs/demo (``kind`` "vision") or runs/translate: the shipped runs."""

    def make(path: Path) -> None:
        source = shipped_run(kind)
        copy_run_files(source, path, [str(f.relative_to(source)) for f in source.rglob("*") if f.is_file()])

    return make


STANDINS: dict[str, Callable[[Path], None]] = {
    "runs/demo/": _demo_run("vision"),
    "runs/translate": _demo_run("translate"),
    "deit_small_patch16_224-cd65a155.pth": _official_release("deit_small_patch16_224"),
    "dynamicvit_0.7.pth": _official_release("dynamicvit_small_patch16_224"),
    "ckpt.safetensors": _timm_weights("deit_small_patch16_224", lambda sd, p: save_file(sd, str(p))),
    "dinov2_reg4.safetensors": _timm_weights("vit_small_patch14_reg4_dinov2", lambda sd, p: save_file(sd, str(p))),
    "eva02_tiny.pth": _timm_weights("eva02_tiny_patch14_224", lambda sd, p: torch.save(sd, p)),
    "hf_vit_dir": _hf_folder("vit"),
    "siglip_dir": _hf_folder("siglip"),
    "cat.jpg": _image,
}


def standins_for(text: str, cache: Path, workdir: Path) -> list[str]:
    """Make (into ``cache``, once) every stand-in whose name ``text`` mentions, and link it into ``workdir``."""
    used = [name for name in STANDINS if name in text]
    for name in used:
        made = cache / name.replace("/", "_")
        if not made.exists():
            STANDINS[name](made)
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name.rstrip("/")).symlink_to(made)
    return used


# Models a page loads with pretrained=True: the repo pretrained=True reads (timm/<name>.<default tag>), put into a
# Hugging Face cache on disk that the page's blocks read offline (HF_HUB_CACHE, HF_HUB_OFFLINE=1).
HUB_STANDINS = {"deit_small_patch16_224": "timm/deit_small_patch16_224.fb_in1k"}


def hub_standins_for(text: str, cache: Path) -> list[str]:
    """Fill the hub cache ``cache`` (once) with a stand-in repo of every model ``text`` loads with pretrained=True."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hub"))
    from hub_cache import add_repo

    used = [name for name in HUB_STANDINS if f'"{name}", pretrained=True' in text]
    for name in used:
        weights = cache.parent / f"{name}.safetensors"
        if not weights.exists():
            _timm_weights(name, lambda sd, p: save_file(sd, str(p)))(weights)
            add_repo(cache, HUB_STANDINS[name], {"model.safetensors": weights})
    return used
