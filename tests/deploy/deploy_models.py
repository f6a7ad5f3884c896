"""Every model kind, tiny, for the deployment tests: dense, DynamicViT (eval and training), every registered reducer.

The reducer list is read from the registry, so a new reducer file is swept by the compile and ONNX tests without
editing them. Weights are perturbed away from the init so that scores and similarities are well separated (a
near-tie would let float round-off between backends pick another token, which says nothing about the export).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import vitrim
from vitrim.reduce import get_reducer, list_reducers

ARCH = dict(embed_dim=32, depth=4, num_heads=2, img_size=32, patch_size=8, num_classes=5)
KINDS = list(dict.fromkeys(["dense", "dynamicvit", "dynamicvit_train", *list_reducers()]))  # reducer "dynamicvit" too


def build(kind: str, seed: int = 0, gumbel_noise: bool = True) -> nn.Module:
    """The tiny model of ``kind``, in eval mode (``dynamicvit_train``: training mode, dropout-free)."""
    torch.manual_seed(seed)
    if kind == "dense":
        model = vitrim.create_model("vit_tiny_patch16_224", **ARCH)
    elif kind.startswith("dynamicvit"):
        model = vitrim.create_model("dynamicvit_tiny_patch16_224", keep_ratio=0.7, **ARCH)
        for pruner in model.pruners:
            pruner.gumbel_noise = gumbel_noise
    else:
        model = vitrim.create_model("vit_tiny_patch16_224", reducer=kind, **get_reducer(kind).example_options, **ARCH)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.train(kind == "dynamicvit_train")


def images(batch: int = 2, seed: int = 1) -> Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
