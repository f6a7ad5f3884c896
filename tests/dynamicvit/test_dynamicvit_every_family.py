"""DynamicViT trains on every registered ViT: a few AdamW steps of its loss, every gradient finite, predictors moved.

Families are found, not listed: registered ViTs are grouped by the architecture fields that change how tokens flow
(prefix tokens, pooling, position embedding, MLP), so a family registered tomorrow is swept without editing this
file. The default run takes the first model of each family; ``full`` runs every registered name.
"""

from __future__ import annotations

import re

import pytest
import torch

import vitrim
from vitrim.losses import DynamicViTLoss

TINY = dict(embed_dim=32, depth=2, num_heads=2, num_classes=5)
FAMILY_FIELDS = (
    "class_token", "distilled", "reg_tokens", "no_embed_class", "pre_norm", "global_pool", "fc_norm", "act_layer",
    "swiglu_mlp", "scale_mlp", "use_rot_pos_emb", "init_values", "qk_norm",
)  # fmt: skip
VITS = [name for name in vitrim.list_models() if not name.startswith("cnn_")]


def _build(name: str) -> torch.nn.Module:
    """A 2-block model of ``name`` on a 4x4 grid with one pruning stage before block 1 (half the patches kept)."""
    patch = int(re.search(r"patch(\d+)", name).group(1))  # type: ignore[union-attr]
    options = dict(TINY, img_size=4 * patch, keep_ratio=0.5, prune_layers=(1,))
    if not name.startswith("dynamicvit_"):
        options["reducer"] = "dynamicvit"
    torch.manual_seed(0)
    return vitrim.create_model(name, **options)


def _family(name: str) -> tuple:
    config = vitrim.create_model(name, **TINY, img_size=64 if "patch16" in name else None).config  # type: ignore[arg-type]
    return tuple(getattr(config, field) for field in FAMILY_FIELDS)


def _first_of_each_family() -> list[str]:
    seen: dict[tuple, str] = {}
    for name in VITS:
        seen.setdefault(_family(name), name)
    return sorted(seen.values())


FIRSTS = _first_of_each_family()
EVERY = [pytest.param(name, marks=pytest.mark.full) for name in VITS if name not in FIRSTS]


def test_the_families_include_the_ones_that_broke() -> None:
    assert len(FIRSTS) >= 7  # DeiT, DeiT-distilled, DeiT-III, DINOv2 ± registers, CLIP, SigLIP, EVA-02, GAP, ...
    pools = {vitrim.create_model(name, **TINY).config.global_pool for name in FIRSTS}  # type: ignore[union-attr]
    assert pools == {"token", "avg", "map"}  # SigLIP's attention pool among them


@pytest.mark.parametrize("name", FIRSTS + EVERY)
def test_training_steps_give_finite_gradients_and_moving_predictors(name: str) -> None:
    model = _build(name).train()
    loss_fn = DynamicViTLoss(keep_ratio=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    size = model.config.img_size  # type: ignore[union-attr]
    for step in range(3):
        images = torch.randn(4, 3, *size, generator=generator)
        labels = torch.randint(0, 5, (4,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model.forward_detailed(images), labels).total  # type: ignore[operator]
        assert torch.isfinite(loss), f"{name} step {step}: loss {loss.item()}"
        loss.backward()
        for param_name, param in model.named_parameters():
            assert param.grad is not None, f"{name} step {step}: {param_name} got no gradient"
            assert torch.isfinite(param.grad).all(), f"{name} step {step}: {param_name} has a non-finite gradient"
            if param_name.startswith("score_predictor."):
                assert param.grad.abs().sum() > 0, f"{name} step {step}: predictor {param_name} got a zero gradient"
        optimizer.step()
