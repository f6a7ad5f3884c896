"""Data configs from files (a hub repo's ``preprocessor_config.json``, timm's ``pretrained_cfg``, a ``run.json``'s
``data_config``): sizes bounded, mean/std finite, std non-zero, each error naming the field, the value and the limit,
before any image is touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import vitrim
from vitrim.models.data_config import MAX_IMAGE_SIDE, DataConfig

PROCESSOR = {"do_center_crop": True, "crop_size": 32, "size": 32, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"size": 10**6},
            rf"preprocessor_config\.json: size\['shortest_edge'\] must be an int from 1 to {MAX_IMAGE_SIDE}",
        ),
        ({"size": 0}, r"size\['shortest_edge'\] must be an int from 1 to \d+ .*got 0"),
        ({"size": {"height": 0, "width": 3}}, r"size\['height'\] must be an int from 1 .*got 0"),
        ({"size": {"height": "224", "width": 3}}, r"size\['height'\] must be an int .*got '224'"),
        ({"size": {"longest": 3}}, r"'size' must be an int or an object with 'shortest_edge' or 'height' and 'width'"),
        ({"size": [224]}, r"'size' must be an int or an object"),
        ({"crop_size": 10**6}, r"crop_size must be an int from 1 to \d+ .*got 1000000"),
        ({"crop_size": {"h": 1}}, r"'crop_size' must be an int or an object with 'height' and 'width'"),
        ({"image_mean": [float("nan")] * 3}, r"'image_mean' must be a list of finite numbers, one per channel"),
        ({"image_std": [float("inf")] * 3}, r"'image_std' must be a list of finite numbers"),
        ({"image_std": [0.5, 0.0, 0.5]}, r"'image_std' must be .*\(all > 0: pixels are divided by them\)"),
        ({"image_std": "abc"}, r"'image_std' must be a list of finite numbers"),
        ({"image_mean": [0.5] * 2}, r"mean \(0\.5, 0\.5\) has 2 value\(s\); input_size \(2, 32, 32\) has 2 channels|"),
        ({"resample": [1]}, r"'resample' must be one of \[0, 1, 2, 3, 4, 5\], got \[1\]"),
        ({"resample": 9}, r"'resample' must be one of"),
    ],
)
def test_preprocessor_configs_are_bounded(changes: dict, expected: str) -> None:
    processor = {**PROCESSOR, **changes}
    if "image_mean" in changes and len(changes["image_mean"]) == 2:  # a 2-channel config: the channels disagree
        processor["image_std"] = [0.5]
        expected = r"image_std|std \(0\.5,\) has 1 value"
    with pytest.raises(ValueError, match=expected) as err:
        DataConfig.from_transformers(processor)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"crop_pct": 1e-5}, r"crop_pct 1e-05 resizes images of input_size \(3, 224, 224\) to 22400000x22400000"),
        ({"crop_pct": 1e6}, r"crop_pct 1000000\.0 resizes images .* to 0x0 before the crop; expected sides from 1 to"),
        # a subnormal crop_pct: the resized side overflows a float (the fuzz found an OverflowError here)
        ({"crop_pct": 2.2250738585072014e-308}, r"crop_pct 2\.2250738585072014e-308 resizes images .* to infxinf"),
        ({"crop_pct": float("nan")}, r"crop_pct must be a positive number .*got nan"),
        (
            {"input_size": [3, 10**6, 10**6]},
            rf"input_size \(3, 1000000, 1000000\) is over the limits .*{MAX_IMAGE_SIDE}",
        ),
        ({"input_size": [3, 0, 224]}, r"input_size must be three positive ints \(C, H, W\), got \[3, 0, 224\]"),
        ({"input_size": 224}, r"input_size must be three positive ints"),
        ({"mean": [float("nan")] * 3}, r"mean must be a list of finite numbers, one per channel, got \[nan"),
        ({"std": [float("inf")] * 3}, r"std must be a list of finite numbers"),
        ({"std": [0.0] * 3}, r"std must be positive \(pixels are divided by it\)"),
        ({"mean": "abc"}, r"mean must be a list of finite numbers"),
        ({"interpolation": ["x"]}, r"interpolation must be one of"),
    ],
)
def test_timm_pretrained_cfgs_are_bounded(fields: dict, expected: str) -> None:
    with pytest.raises(ValueError, match="pretrained_cfg: " + expected):
        DataConfig.from_timm(fields)


def test_run_json_data_config_names_the_file() -> None:
    with pytest.raises(ValueError, match=r"run\.json: unknown field\(s\) \['evil'\]"):
        DataConfig.from_record({"evil": 1}, "run.json")
    with pytest.raises(ValueError, match=r"run\.json: std must be positive"):
        DataConfig.from_record({"std": [0, 0, 0]}, "run.json")
    assert DataConfig.from_record({"input_size": [1, 8, 8], "mean": [0.5], "std": [0.5]}, "r").input_size == (1, 8, 8)


def test_a_hub_folder_with_a_hostile_processor_is_refused_before_any_image(tmp_path: Path) -> None:
    config = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=32, patch_size=16
    )
    torch.manual_seed(0)
    transformers.ViTModel(config, add_pooling_layer=False).save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR, "crop_size": 1, "size": 10**6}))
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: size\['shortest_edge'\] must be an int from 1"):
        vitrim.load_model(tmp_path / "model.safetensors")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR, "image_std": [0, 0, 0]}))
    with pytest.raises(ValueError, match=r"'image_std' must be a list of finite numbers"):
        vitrim.load_model(tmp_path / "model.safetensors")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    assert vitrim.load_model(tmp_path / "model.safetensors").data_config.input_size == (3, 32, 32)
