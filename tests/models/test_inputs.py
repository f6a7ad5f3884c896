"""Wrong images get a clear error from the model before any compute (PatchEmbed.check_input, seen from outside)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import vitrim

VIT_NAMES = [name for name in vitrim.list_models() if name.startswith(("vit_", "deit_", "dynamicvit_"))]


def tiny(name: str = "vit_tiny_patch16_224") -> nn.Module:
    patch = int(re.search(r"patch(\d+)", name).group(1))  # type: ignore[union-attr]
    depth = 4 if name.startswith("dynamicvit_") else 2
    return vitrim.create_model(name, embed_dim=32, depth=depth, num_heads=2, img_size=2 * patch, num_classes=3).eval()


def guard(model: nn.Module) -> list[int]:
    """Record every call of the first layer: a refused input must not reach it."""
    calls: list[int] = []
    model.patch_embed.proj.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((2, 3, 33, 32), "image height 33 is not divisible by patch size 16"),
        ((2, 3, 32, 40), "image width 40 is not divisible by patch size 16"),
        ((2, 1, 32, 32), r"images have 1 channels, but the model expects in_chans=3"),
        ((3, 32, 32), r"images must have shape \(B, C, H, W\), got \(3, 32, 32\)"),
        ((1, 2, 3, 32, 32), r"images must have shape \(B, C, H, W\), got \(1, 2, 3, 32, 32\)"),
        ((2, 3, 0, 32), "image height 0 is not divisible by patch size 16"),
    ],
)
@pytest.mark.parametrize("entry", ["forward", "forward_detailed", "forward_features"])
def test_bad_images_are_refused_before_compute(shape: tuple[int, ...], message: str, entry: str) -> None:
    model = tiny()
    calls = guard(model)
    with pytest.raises(ValueError, match=message):
        getattr(model, entry)(torch.zeros(shape))
    assert calls == []


@pytest.mark.parametrize("name", vitrim.list_models())
@pytest.mark.parametrize(
    ("batch", "dtype", "error", "message"),
    [
        (1, torch.float64, TypeError, r"images have dtype torch.float64, but the model"),
        (1, torch.uint8, TypeError, r"images must be floating point, got dtype torch.uint8"),
        (1, torch.int64, TypeError, r"images must be floating point, got dtype torch.int64"),
        (0, torch.float32, ValueError, r"at least one image"),
    ],
    ids=["float64", "uint8", "int64", "empty-batch"],
)
def test_every_model_refuses_wrong_dtypes_before_its_first_layer(
    name: str, batch: int, dtype: torch.dtype, error: type[Exception], message: str
) -> None:
    small = {} if name.startswith("cnn") else {"embed_dim": 32, "num_heads": 2, "depth": 4}
    model = vitrim.create_model(name, **small, num_classes=3)
    side = 2 * getattr(model.config, "patch_size", 16)
    images = torch.zeros(batch, model.config.in_chans, side, side, dtype=dtype)
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    calls: list[int] = []
    first.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(error, match=message):
        model(images)
    assert calls == []


def test_autocast_accepts_the_dtypes_it_casts_and_refuses_float64() -> None:
    model = tiny()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert model(torch.zeros(1, 3, 32, 32, dtype=dtype)).shape == (1, 3)
        with pytest.raises(TypeError, match=r"images have dtype torch\.float64"):
            model(torch.zeros(1, 3, 32, 32, dtype=torch.float64))


def test_not_a_tensor_is_a_type_error() -> None:
    model = tiny()
    with pytest.raises(TypeError, match=r"images must be a torch\.Tensor, got ndarray"):
        model(torch.zeros(1, 3, 32, 32).numpy())


@pytest.mark.parametrize("name", VIT_NAMES)
def test_every_vit_refuses_a_bad_size_and_accepts_other_multiples(name: str) -> None:
    model = tiny(name)
    patch = model.config.patch_size
    calls = guard(model)
    with pytest.raises(ValueError, match=f"image width {3 * patch + 1} is not divisible by patch size {patch}"):
        model(torch.zeros(1, 3, 2 * patch, 3 * patch + 1))
    assert calls == []
    with torch.no_grad():  # any multiple of the patch size runs (the position embedding is resampled)
        assert model(torch.zeros(1, 3, 3 * patch, 2 * patch)).shape == (1, 3)


def test_create_model_refuses_bad_sizes_naming_them() -> None:
    with pytest.raises(ValueError, match="image size 33 is not divisible by patch size 16"):
        vitrim.create_model("vit_tiny_patch16_224", img_size=33)
    with pytest.raises(ValueError, match="embed_dim 30 is not divisible by num_heads 4"):
        vitrim.create_model("vit_tiny_patch16_224", embed_dim=30, num_heads=4, depth=1)
    with pytest.raises(ValueError, match=r"unknown model 'vit_tiny_patch16'; did you mean"):
        vitrim.create_model("vit_tiny_patch16")
