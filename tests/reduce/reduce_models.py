"""Tiny models and images shared by the reducer tests (embed 32, 16 patches of 8×8 on a 32×32 image)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

import vitrim
from vitrim.attention import AttentionResult
from vitrim.reduce import TokenState

TINY = dict(embed_dim=32, depth=4, num_heads=2, img_size=32, patch_size=8, num_classes=5)


def tiny(seed: int = 0, **changes: object) -> nn.Module:
    """A tiny ViT in eval mode with a fixed random init."""
    torch.manual_seed(seed)
    return vitrim.create_model("vit_tiny_patch16_224", **{**TINY, **changes}).eval()


def peaky_float64(name: str, seed: int) -> nn.Module:
    """A tiny float64 model in eval mode (64×64 images, 64 patches) with every weight perturbed by N(0, 0.2²): peaky
    attention, so that which tokens a reducer picks matters, for comparisons with the authors' forwards."""
    torch.manual_seed(seed)
    model = vitrim.create_model(name, **{**TINY, "img_size": 64}).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return model


def images(batch: int = 2, size: int = 32, seed: int = 1) -> Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def states_per_block(model: nn.Module, x: Tensor) -> list[TokenState]:
    """The token state after each block (block by block, as forward_blocks runs them)."""
    state = model.embed(x)
    states = []
    for block in model.blocks:
        state, _ = block(state)
        states.append(state)
    return states


def assert_patches_left_per_block(model: nn.Module, left_after: Callable[[int], int]) -> None:
    """Every image of four seeded batches (1 to 4 images) holds ``left_after(block)`` patch tokens after each block:
    a count a server writes before the tower runs must hold for any image, alone or in a batch."""
    for seed in range(4):
        with torch.no_grad():
            states = states_per_block(model, images(batch=1 + seed, seed=seed))
        for block, state in enumerate(states):
            assert state.num_patch_tokens == left_after(block), (seed, block)


def attention_info(
    q: Tensor,
    k: Tensor,
    weights: Tensor | None = None,
    mask: Tensor | None = None,
    keep_policy: Tensor | None = None,
    scale: float = 1.0,
) -> AttentionResult:
    """What a block's attention hands its reducer, built from q and k (the output is not used by reducers)."""
    return AttentionResult(q.new_zeros(0), weights, q, k, scale, mask, keep_policy)
