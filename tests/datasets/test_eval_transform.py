"""``vitrim.data.eval_transform`` against timm's own eval transform (``timm.data.create_transform``), on JPEGs of
several sizes and aspect ratios written and read back by the test, for every crop mode timm has."""

from __future__ import annotations

import dataclasses
import io
import pickle

import numpy as np
import pytest
import torch

from vitrim.data import eval_transform
from vitrim.models import build_model
from vitrim.models.data_config import CLIP, DEIT, DINOV2, DataConfig

timm_data = pytest.importorskip("timm.data")
Image = pytest.importorskip("PIL.Image")

# (height, width) of the pictures: square, landscape, portrait, smaller than the input, odd sides
PICTURE_SIZES = [(300, 300), (240, 400), (413, 187), (50, 70), (225, 224)]
CONFIGS = {
    "deit": DEIT,
    "clip 0.95": CLIP,
    "dinov2 no crop": DINOV2,
    "bilinear 0.875 non-square": DataConfig(input_size=(3, 96, 128), interpolation="bilinear", crop_pct=0.875),
    "squash": DataConfig(input_size=(3, 64, 64), crop_mode="squash", crop_pct=0.9),
    "squash non-square": DataConfig(input_size=(3, 80, 48), crop_mode="squash", crop_pct=1.0, interpolation="nearest"),
    "border": DataConfig(input_size=(3, 64, 64), crop_mode="border", crop_pct=1.0, mean=(0.2, 0.5, 0.9)),
    "border non-square": DataConfig(input_size=(3, 48, 80), crop_mode="border", crop_pct=0.9, interpolation="lanczos"),
}


def jpeg(height: int, width: int, seed: int) -> Image.Image:
    """A JPEG of smooth colour ramps and noise, decoded again (what a user's file gives)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    ramps = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (height + width)], axis=-1)
    pixels = np.clip(ramps + rng.normal(0, 30, ramps.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="JPEG", quality=90)
    buffer.seek(0)
    return Image.open(buffer)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_eval_transform_is_timm_s(name: str) -> None:
    config = CONFIGS[name]
    ours = eval_transform(config)
    theirs = timm_data.create_transform(**dataclasses.asdict(config), is_training=False)
    for seed, (height, width) in enumerate(PICTURE_SIZES):
        image = jpeg(height, width, seed)
        expected = theirs(image)
        got = ours(image)
        assert got.shape == expected.shape == (3, *config.input_size[1:]), (height, width)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_a_model_s_data_config_gives_timm_s_transform_for_it() -> None:
    model = build_model("vit_small_patch14_dinov2", img_size=56, depth=1, embed_dim=32, num_heads=2)
    config = model.data_config
    assert config.input_size == (3, 56, 56)
    image = jpeg(120, 90, 0)
    expected = timm_data.create_transform(**dataclasses.asdict(config), is_training=False)(image)
    torch.testing.assert_close(eval_transform(config)(image), expected, atol=1e-6, rtol=0)
    assert model(eval_transform(config)(image)[None]).shape == (1, 1000)


def test_normalisation_is_the_config_s_mean_and_std_by_hand() -> None:
    # a flat grey picture: after the resize and crop every pixel is still 128, so each channel is (128/255 - m) / s
    config = DataConfig(input_size=(3, 32, 32), mean=(0.1, 0.2, 0.3), std=(0.5, 0.25, 0.125))
    out = eval_transform(config)(Image.new("RGB", (50, 40), (128, 128, 128)))
    for channel, (m, s) in enumerate(zip(config.mean, config.std)):
        torch.testing.assert_close(out[channel], torch.full((32, 32), (128 / 255 - m) / s), atol=1e-6, rtol=0)


def test_other_modes_are_converted_to_the_model_s_channels() -> None:
    rgba = Image.new("RGBA", (40, 40), (10, 20, 30, 0))
    assert eval_transform(DataConfig(input_size=(3, 32, 32)))(rgba).shape == (3, 32, 32)
    grey = DataConfig(input_size=(1, 32, 32), mean=(0.5,), std=(0.5,))
    assert eval_transform(grey)(jpeg(40, 60, 1)).shape == (1, 32, 32)


def test_the_transform_pickles_for_data_loader_workers() -> None:
    transform = pickle.loads(pickle.dumps(eval_transform(CONFIGS["border non-square"])))
    image = jpeg(70, 50, 2)
    torch.testing.assert_close(transform(image), eval_transform(CONFIGS["border non-square"])(image))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"crop_mode": "centre"}, "crop_mode must be one of"),
        ({"interpolation": "cubic"}, "interpolation must be one of"),
        ({"crop_pct": 0}, "crop_pct must be a positive number"),
        ({"mean": (0.5, 0.5)}, "mean (0.5, 0.5) has 2 value(s); input_size (3, 224, 224) has 3 channels"),
        ({"input_size": (3, 224)}, "input_size must be three positive ints"),
    ],
)
def test_a_bad_data_config_is_a_clear_error(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DataConfig(**changes)


def test_eval_transform_refuses_what_is_not_a_data_config() -> None:
    with pytest.raises(TypeError, match="data_config must be a vitrim DataConfig"):
        eval_transform({"input_size": (3, 224, 224)})  # type: ignore[arg-type]


def test_viz_image_uses_the_model_s_eval_transform_and_a_trained_digits_model_keeps_its_own(tmp_path) -> None:
    import argparse

    import vitrim
    from vitrim.cli.viz import load_picture
    from vitrim.data.images import read_image

    path = tmp_path / "photo.jpg"
    jpeg(90, 60, 3).save(path)
    args = argparse.Namespace(image=str(path), digits=None)
    named = build_model("deit_tiny_patch16_224", img_size=32, depth=1)
    expected = timm_data.create_transform(**dataclasses.asdict(named.data_config), is_training=False)(Image.open(path))
    torch.testing.assert_close(load_picture(args, named), expected, atol=1e-6, rtol=0)
    trained = vitrim.load_model(vitrim.save_checkpoint(named, tmp_path / "trained.safetensors"))  # no data config
    assert not hasattr(trained, "data_config")
    torch.testing.assert_close(load_picture(args, trained), read_image(path, (32, 32), 3))
