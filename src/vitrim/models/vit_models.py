"""Registered ViT and DeiT entry points (timm's names and sizes)."""

from __future__ import annotations

from typing import Any

from vitrim.models.config import ViTConfig
from vitrim.models.data_config import DEIT
from vitrim.models.registry import register_model
from vitrim.models.vit import VisionTransformer


def build_vit(defaults: dict[str, Any], overrides: dict[str, Any]) -> VisionTransformer:
    """A ViT from a size's defaults, then the user's overrides (timm's names)."""
    return VisionTransformer(ViTConfig().replace(**{**defaults, **overrides}))


TINY = dict(embed_dim=192, depth=12, num_heads=3)
SMALL = dict(embed_dim=384, depth=12, num_heads=6)
BASE = dict(embed_dim=768, depth=12, num_heads=12)
LARGE = dict(embed_dim=1024, depth=24, num_heads=16)


@register_model
def vit_tiny_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(TINY, patch_size=16), overrides)


@register_model
def vit_small_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(SMALL, patch_size=16), overrides)


@register_model
def vit_base_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, patch_size=16), overrides)


@register_model
def vit_large_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(LARGE, patch_size=16), overrides)


@register_model
def vit_base_patch32_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, patch_size=32), overrides)


@register_model
def vit_base_patch16_384(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, patch_size=16, img_size=384), overrides)


@register_model(data=DEIT)
def deit_tiny_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(TINY, patch_size=16), overrides)


@register_model(data=DEIT)
def deit_small_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(SMALL, patch_size=16), overrides)


@register_model(data=DEIT)
def deit_base_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, patch_size=16), overrides)


@register_model(data=DEIT)
def deit_tiny_distilled_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(TINY, patch_size=16, distilled=True), overrides)


@register_model(data=DEIT)
def deit_small_distilled_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(SMALL, patch_size=16, distilled=True), overrides)


@register_model(data=DEIT)
def deit_base_distilled_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, patch_size=16, distilled=True), overrides)
