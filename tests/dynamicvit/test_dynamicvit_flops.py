"""Compute really shrinks: the FLOP counter agrees with a hand count of DynamicViT's eval forward."""

from __future__ import annotations

import pytest

import vitrim
from vitrim.bench.flops import model_flops_per_image


def block_flops(n: int, c: int) -> int:
    """One pre-norm block on n tokens of width c (matmuls only, 2 per multiply-add): qkv 6nc², QKᵀ and A·V 4n²c,
    proj 2nc², MLP (ratio 4) 16nc²."""
    return 24 * n * c * c + 4 * n * n * c


def predictor_flops(n: int, c: int) -> int:
    """The prediction module on n patch tokens: Linear c->c, c->c/2 (on [local, global], as the authors
    concatenate them), c/2->c/4, c/4->2."""
    per_token = c * c + c * (c // 2) + (c // 2) * (c // 4) + (c // 4) * 2
    return 2 * n * per_token


def hand_count(c: int, keep: list[int] | None, classes: int = 1000) -> int:
    """A 224/16 DeiT of width c and depth 12 (196 patches), pruned before blocks 3, 6, 9 to ``keep`` tokens."""
    total = 2 * 196 * (3 * 16 * 16) * c + 2 * c * classes  # patch embedding, head
    n, stages = 196, dict(zip((3, 6, 9), keep or []))
    for i in range(12):
        if i in stages:
            total += predictor_flops(n, c)
            n = stages[i]
        total += block_flops(1 + n, c)
    return total


def test_counter_matches_the_hand_count_dense_and_pruned() -> None:
    # full token structure (224/16, depth 12, stages 137/96/67), narrow width so the test stays fast
    kw = dict(embed_dim=32, num_heads=2, num_classes=10)
    dense = vitrim.create_model("deit_small_patch16_224", **kw).eval()
    dyn = vitrim.create_model("dynamicvit_small_patch16_224", **kw).eval()
    assert model_flops_per_image(dense, 224) == hand_count(32, None, classes=10)
    assert model_flops_per_image(dyn, 224) == hand_count(32, [137, 96, 67], classes=10)


def test_dynamicvit_small_needs_at_least_35_percent_fewer_flops_than_deit_small() -> None:
    dense, dyn = hand_count(384, None), hand_count(384, [137, 96, 67])
    assert dense / 1e9 == pytest.approx(9.20, abs=0.005)  # the official numbers: 9.20 and 5.96 GFLOPs
    assert dyn / 1e9 == pytest.approx(5.96, abs=0.005)
    assert dyn <= 0.65 * dense
