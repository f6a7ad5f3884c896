"""Every model kind on every family, tiny, for the deployment tests: dense, DynamicViT (eval and training), every
registered reducer, on the plain ViT and on each family people run (registers, RoPE, layer scale, no [CLS], …).

The reducer list is read from the registry, so a new reducer file is swept by the compile and ONNX tests without
editing them. Weights are perturbed away from the init so that scores and similarities are well separated (a
near-tie would let float round-off between backends pick another token, which says nothing about the export).

The sweeps run the whole cross product family × kind in ``make test-all``; ``make test`` runs its diagonal, a subset
in which every kind and every family appears at least once, and CI (``make test-full``) the whole product or, where
a sweep asks for it with ``ci_diagonals``, a few diagonals (the ONNX export, 11 to 80 s a case: every kind on two
families; see :func:`cases`).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import vitrim
from vitrim.reduce import get_reducer, list_reducers

ARCH = dict(embed_dim=32, depth=4, num_heads=2, num_classes=5)
PLAIN = "vit_tiny_patch16_224"
FAMILIES = {  # name -> image side giving a 4x4 patch grid
    PLAIN: 32,  # patch 8 here (ARCH_PLAIN), as the plain sweeps always ran
    "deit3_small_patch16_224": 64,  # layer scale, position on patches only
    "vit_small_patch14_dinov2": 56,
    "vit_small_patch14_reg4_dinov2": 56,  # 4 registers
    "vit_base_patch16_clip_224": 64,  # norm before the blocks, no patch bias
    "vit_base_patch16_siglip_224": 64,  # no [CLS]; attention-pool head
    "eva02_tiny_patch14_224": 56,  # RoPE by absolute position, SwiGLU
    "vit_medium_patch16_gap_256": 64,  # no [CLS]; mean pool
}
NO_CLS = {"vit_base_patch16_siglip_224", "vit_medium_patch16_gap_256"}
KINDS = list(dict.fromkeys(["dense", "dynamicvit", "dynamicvit_train", *list_reducers()]))  # reducer "dynamicvit" too


def fits(family: str, kind: str) -> bool:
    """Whether ``kind`` runs on ``family``: reducers that rank by [CLS] attention refuse models without [CLS]."""
    needs_cls = kind in list_reducers() and get_reducer(kind).needs_cls_token
    return not (needs_cls and family in NO_CLS)


def _diagonal(kinds: list[str], taken: frozenset[tuple[str, str]] = frozenset()) -> list[tuple[str, str]]:
    """Every kind once, each on the family it fits that is least used so far (ties in ``FAMILIES`` order), so every
    family appears too when there are at least as many kinds as families; pairs in ``taken`` are not chosen again
    (a second diagonal puts every kind on another family)."""
    uses = dict.fromkeys(FAMILIES, 0)
    for family, _ in taken:
        uses[family] += 1
    chosen = []
    for kind in kinds:
        family = min((f for f in FAMILIES if fits(f, kind) and (f, kind) not in taken), key=lambda f: uses[f])
        uses[family] += 1
        chosen.append((family, kind))
    return chosen + [(family, "dense") for family, n in uses.items() if n == 0 and (family, "dense") not in taken]


def cases(
    kinds: list[str], every: int = 1, slow: frozenset[str] = frozenset(), ci_diagonals: int | None = None
) -> list[object]:
    """pytest params (family, kind) of the cross product; those off the diagonal are marked ``full``. ``every=N``:
    only every N-th diagonal case runs in ``make test`` (``every=len(kinds)``: the dense plain ViT alone, for a sweep
    whose cases each cost many seconds, such as the ONNX export); ``slow`` kinds run in ``make test-full`` only. With
    ``ci_diagonals=N`` CI runs N diagonals (every kind on N families) and the pairs beyond them are also marked
    ``exhaustive``: ``make test-all`` runs them, CI does not (the ONNX export's whole product is an hour of 2 cores)."""
    first = _diagonal(kinds)
    diagonal = {(family, kind) for family, kind in first[::every] if kind not in slow}
    in_ci = set(first)
    for _ in range((ci_diagonals or 1) - 1):
        in_ci |= set(_diagonal(kinds, frozenset(in_ci)))
    params = []
    for family in FAMILIES:
        for kind in kinds:
            if not fits(family, kind):
                continue
            marks = [] if (family, kind) in diagonal else [pytest.mark.full]
            if ci_diagonals is not None and (family, kind) not in in_ci:
                marks.append(pytest.mark.exhaustive)
            params.append(pytest.param(family, kind, marks=marks))
    return params


def build(kind: str, seed: int = 0, gumbel_noise: bool = True, family: str = PLAIN) -> nn.Module:
    """The tiny model of ``kind`` on ``family``, in eval mode (``dynamicvit_train``: training mode, dropout-free)."""
    torch.manual_seed(seed)
    size = dict(img_size=FAMILIES[family], **({"patch_size": 8} if family == PLAIN else {}))
    if kind == "dense":
        model = vitrim.create_model(family, **size, **ARCH)
    elif kind.startswith("dynamicvit"):
        if family == PLAIN:
            model = vitrim.create_model("dynamicvit_tiny_patch16_224", keep_ratio=0.7, **size, **ARCH)
        else:
            model = vitrim.create_model(family, reducer="dynamicvit", keep_ratio=0.7, **size, **ARCH)
        for block in model.blocks:
            if block.reducer is not None:
                block.reducer.gumbel_noise = gumbel_noise
    else:
        model = vitrim.create_model(family, reducer=kind, **get_reducer(kind).example_options, **size, **ARCH)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.train(kind == "dynamicvit_train")


def images(batch: int = 2, seed: int = 1, family: str = PLAIN) -> Tensor:
    side = FAMILIES[family]
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(seed))
