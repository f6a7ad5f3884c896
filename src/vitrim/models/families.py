"""The ViT families people run today, under timm's names and defaults: DeiT-III, DINOv2 (with registers), CLIP,
SigLIP, EVA-02 and a ViT without [CLS]. Each is the one :class:`~vitrim.models.vit.VisionTransformer` with the config
fields its family needs (see :class:`~vitrim.models.config.ViTConfig`):

| family | what is special | pooling |
|---|---|---|
| DeiT-III | layer scale, position embedding on patches only | [CLS] |
| DINOv2 | patch 14, layer scale, 518 px | [CLS] |
| DINOv2 + registers | 4 register tokens (prefix, no position), position on patches only | [CLS] |
| CLIP | LayerNorm before the blocks, no patch bias, LayerNorm eps 1e-5 | [CLS] |
| SigLIP | no [CLS], attention-pool (MAP) head | attention pool |
| EVA-02 | 2-D RoPE on q and k, SwiGLU MLP | mean + fc_norm |
| ViT-M GAP | no [CLS], no qkv bias, layer scale | mean (final norm before it) |
"""

from __future__ import annotations

from typing import Any

from vitrim.models.data_config import CLIP, DEIT, DINOV2, EVA02, GAP, SIGLIP
from vitrim.models.registry import register_model
from vitrim.models.vit import VisionTransformer
from vitrim.models.vit_models import BASE, LARGE, SMALL, build_vit

MEDIUM = dict(embed_dim=512, depth=12, num_heads=8)
DEIT3 = dict(patch_size=16, no_embed_class=True, init_values=1e-6)
DINO = dict(patch_size=14, init_values=1e-5, img_size=518)
DINO_REG = dict(DINO, reg_tokens=4, no_embed_class=True)
CLIP_VIT = dict(pre_norm=True, norm_eps=1e-5)
SIGLIP_VIT = dict(patch_size=16, class_token=False, global_pool="map")
EVA = dict(  # mean of the patches, then fc_norm, as EVA pools
    patch_size=14,
    mlp_ratio=4 * 2 / 3,
    swiglu_mlp=True,
    use_rot_pos_emb=True,
    ref_feat_shape=(16, 16),
    global_pool="avg",
)


@register_model(data=DEIT)
def deit3_small_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(SMALL, **DEIT3), overrides)


@register_model(data=DEIT)
def deit3_medium_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(MEDIUM, **DEIT3), overrides)


@register_model(data=DEIT)
def deit3_base_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, **DEIT3), overrides)


@register_model(data=DEIT)
def deit3_large_patch16_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(LARGE, **DEIT3), overrides)


@register_model(data=DINOV2)
def vit_small_patch14_dinov2(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(SMALL, **DINO), overrides)


@register_model(data=DINOV2)
def vit_base_patch14_dinov2(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, **DINO), overrides)


@register_model(data=DINOV2)
def vit_large_patch14_dinov2(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(LARGE, **DINO), overrides)


@register_model(data=DINOV2)
def vit_small_patch14_reg4_dinov2(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(SMALL, **DINO_REG), overrides)


@register_model(data=DINOV2)
def vit_base_patch14_reg4_dinov2(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, **DINO_REG), overrides)


@register_model(data=DINOV2)
def vit_large_patch14_reg4_dinov2(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(LARGE, **DINO_REG), overrides)


@register_model(data=CLIP)
def vit_base_patch32_clip_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, patch_size=32, **CLIP_VIT), overrides)


@register_model(data=CLIP)
def vit_base_patch16_clip_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, patch_size=16, **CLIP_VIT), overrides)


@register_model(data=CLIP)
def vit_base_patch16_clip_quickgelu_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, patch_size=16, act_layer="quick_gelu", **CLIP_VIT), overrides)


@register_model(data=CLIP)
def vit_large_patch14_clip_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(LARGE, patch_size=14, **CLIP_VIT), overrides)


@register_model(data=SIGLIP)
def vit_base_patch16_siglip_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, **SIGLIP_VIT), overrides)


@register_model(data=SIGLIP)
def vit_base_patch16_siglip_256(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(BASE, img_size=256, **SIGLIP_VIT), overrides)


@register_model(data=SIGLIP)
def vit_large_patch16_siglip_256(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(LARGE, img_size=256, **SIGLIP_VIT), overrides)


@register_model(data=EVA02)
def eva02_tiny_patch14_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(embed_dim=192, depth=12, num_heads=3, **EVA), overrides)


@register_model(data=EVA02)
def eva02_small_patch14_224(**overrides: Any) -> VisionTransformer:
    return build_vit(dict(embed_dim=384, depth=12, num_heads=6, **EVA), overrides)


@register_model(data=GAP)
def vit_medium_patch16_gap_256(**overrides: Any) -> VisionTransformer:
    gap = dict(class_token=False, global_pool="avg", qkv_bias=False, init_values=1e-6, fc_norm=False)
    return build_vit(dict(MEDIUM, patch_size=16, img_size=256, **gap), overrides)
