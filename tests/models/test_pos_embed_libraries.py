"""Position embeddings at another image size are resampled as the weights' library resamples them: transformers'
``interpolate_pos_encoding`` (bicubic, no antialias for ViT, DINOv2, CLIP and SigLIP; antialiased for DINOv2 with
registers) for weights from transformers, timm's ``resample_abs_pos_embed`` (bicubic, antialiased) for timm's
(tests/models/test_in_memory.py and the timm fixtures check timm's at a larger size). Each comparison is with the
library's own output; the other way of resampling is shown to give other numbers, so the checks can fail."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import vitrim

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
VISION = dict(SMALL, intermediate_size=64, image_size=48, patch_size=16)
HF = {  # (a model trained on a 3x3 grid, whether transformers antialiases when it resamples)
    "vit": (lambda: transformers.ViTModel(transformers.ViTConfig(**VISION), add_pooling_layer=False), False),
    "dinov2": (
        lambda: transformers.Dinov2Model(transformers.Dinov2Config(**SMALL, image_size=42, patch_size=14)),
        False,
    ),
    "dinov2_with_registers": (
        lambda: transformers.Dinov2WithRegistersModel(
            transformers.Dinov2WithRegistersConfig(**SMALL, image_size=42, patch_size=14, num_register_tokens=2)
        ),
        True,
    ),
    "clip": (lambda: transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**VISION)), False),
    "siglip": (lambda: transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**VISION)), False),
}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def hf_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = HF[kind][0]()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def hf_tokens(kind: str, hf: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The final normalised tokens, prefix first, with transformers resampling its position embedding."""
    out = hf(pixel_values=x, **({} if kind.startswith("dinov2") else {"interpolate_pos_encoding": True}))
    tokens = out.last_hidden_state
    if kind == "clip":  # CLIP normalises only the pooled [CLS] token; vitrim's norm is that same LayerNorm
        tokens = hf.post_layernorm(tokens)
    return tokens


@pytest.mark.parametrize("kind", sorted(HF))
def test_weights_from_transformers_resample_as_transformers_does(kind: str) -> None:
    hf = hf_model(kind)
    antialias = HF[kind][1]
    model = vitrim.from_transformers(hf)
    assert model.config.pos_embed_antialias is antialias
    patch = model.config.patch_size
    generator = torch.Generator().manual_seed(1)
    for grid in ((5, 4), (2, 2)):  # larger and non-square, then smaller (where antialiasing acts most)
        x = torch.randn(2, 3, grid[0] * patch, grid[1] * patch, generator=generator)
        with torch.no_grad():
            expected, ours = hf_tokens(kind, hf, x), model.forward_features(x)
            assert relative(ours, expected) <= 1e-5, grid
            other = dataclasses.replace(model.config, pos_embed_antialias=not antialias)
            model.config, saved = other, model.config
            assert relative(model.forward_features(x), expected) > 1e-3, grid  # the other way is not the same
            model.config = saved


def test_loading_at_another_size_resamples_once_as_transformers_does(tmp_path: Path) -> None:
    hf = hf_model("vit")
    hf.save_pretrained(tmp_path)
    model = vitrim.load_model(tmp_path, img_size=(64, 80))  # the checkpoint's 3x3 grid becomes 4x5 when it loads
    x = torch.randn(2, 3, 64, 80, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative(model.forward_features(x), hf_tokens("vit", hf, x)) <= 1e-5
    sizes = dict(embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0, img_size=48, num_classes=0, norm_eps=1e-12)
    timm_way = vitrim.create_model("vit_base_patch16_224", **sizes)
    assert timm_way.config.pos_embed_antialias is True  # a model built by name resamples as timm does ...
    vitrim.load_checkpoint(timm_way, tmp_path)
    assert timm_way.config.pos_embed_antialias is False  # ... until transformers' weights load into it
