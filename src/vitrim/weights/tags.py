"""timm's pretrained weights by name: ``"vit_base_patch16_224.augreg2_in21k_ft_in1k"`` is the architecture
``vit_base_patch16_224`` with the weights of the hub repo ``timm/vit_base_patch16_224.augreg2_in21k_ft_in1k``.

A name without a tag gets the architecture's default tag, the first of timm's ``default_cfgs`` for it (the table
below; tests/models/test_pretrained_tags.py checks it, and every repo name, against timm's own registry). The
QuickGELU CLIP variants read the weights of the plain CLIP architecture's repos, as timm's ``hf_hub_id`` says. The
DynamicViT architectures start from DeiT's weights (the paper fine-tunes DeiT), their score predictors fresh.
"""

from __future__ import annotations

DEFAULT_TAGS = {
    "deit_tiny_patch16_224": "fb_in1k",
    "deit_small_patch16_224": "fb_in1k",
    "deit_base_patch16_224": "fb_in1k",
    "deit_tiny_distilled_patch16_224": "fb_in1k",
    "deit_small_distilled_patch16_224": "fb_in1k",
    "deit_base_distilled_patch16_224": "fb_in1k",
    "deit3_small_patch16_224": "fb_in1k",
    "deit3_medium_patch16_224": "fb_in1k",
    "deit3_base_patch16_224": "fb_in1k",
    "deit3_large_patch16_224": "fb_in1k",
    "vit_tiny_patch16_224": "augreg_in21k_ft_in1k",
    "vit_small_patch16_224": "augreg_in21k_ft_in1k",
    "vit_base_patch16_224": "augreg2_in21k_ft_in1k",
    "vit_large_patch16_224": "augreg_in21k_ft_in1k",
    "vit_base_patch32_224": "augreg_in21k_ft_in1k",
    "vit_base_patch16_384": "augreg_in21k_ft_in1k",
    "vit_small_patch14_dinov2": "lvd142m",
    "vit_base_patch14_dinov2": "lvd142m",
    "vit_large_patch14_dinov2": "lvd142m",
    "vit_small_patch14_reg4_dinov2": "lvd142m",
    "vit_base_patch14_reg4_dinov2": "lvd142m",
    "vit_large_patch14_reg4_dinov2": "lvd142m",
    "vit_base_patch32_clip_224": "laion2b_ft_in12k_in1k",
    "vit_base_patch16_clip_224": "laion2b_ft_in12k_in1k",
    "vit_base_patch16_clip_quickgelu_224": "metaclip_2pt5b",
    "vit_large_patch14_clip_224": "laion2b_ft_in12k_in1k",
    "vit_base_patch16_siglip_224": "v2_webli",
    "vit_base_patch16_siglip_256": "v2_webli",
    "vit_large_patch16_siglip_256": "v2_webli",
    "eva02_tiny_patch14_224": "mim_in22k",
    "eva02_small_patch14_224": "mim_in22k",
    "vit_medium_patch16_gap_256": "sw_in12k_ft_in1k",
}
# architectures whose weights live in another architecture's repos
WEIGHTS_OF = {
    "vit_base_patch16_clip_quickgelu_224": "vit_base_patch16_clip_224",
    "dynamicvit_tiny_patch16_224": "deit_tiny_patch16_224",
    "dynamicvit_small_patch16_224": "deit_small_patch16_224",
    "dynamicvit_base_patch16_224": "deit_base_patch16_224",
}


def split_tag(name: str) -> tuple[str, str | None]:
    """``"arch.tag"`` -> ``("arch", "tag")``; ``"arch"`` -> ``("arch", None)``."""
    arch, _, tag = name.partition(".")
    return arch, tag or None


def pretrained_repo(name: str) -> tuple[str, str]:
    """``"arch[.tag]"`` -> (the architecture, the hub repo of its weights: ``"timm/<arch>.<tag>"``).

    The tag defaults to the architecture's default (see the module doc); an architecture that has no timm weights
    is a ValueError saying so.
    """
    arch, tag = split_tag(name)
    source = WEIGHTS_OF.get(arch, arch)
    tag = tag or DEFAULT_TAGS.get(source)
    if tag is None:
        raise ValueError(
            f"no pretrained weights are known for {arch!r}: timm has none under that name. Load weights by path "
            "(checkpoint=...) or by hub repo (vitrim.load_model('hf-hub:ORG/NAME'))"
        )
    return arch, f"timm/{source}.{tag}"
