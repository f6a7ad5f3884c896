"""vitrim reproduces timm's numbers from timm's own weights (fixtures in tests/data/timm, written by timm 1.0.31).

Each case in manifest.json names the timm model and overrides; its io file holds timm's input, logits, pre_logits
(forward_head(forward_features(x), pre_logits=True)) and logits at a larger, non-square input (timm resampling
the position embedding on the fly).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import vitrim

DATA = Path(__file__).resolve().parents[1] / "data" / "timm"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
CASES = sorted(MANIFEST["cases"])
TOL = dict(rtol=1e-5, atol=1e-5)


def build(case: dict, **changes: object) -> nn.Module:
    return vitrim.create_model(case["timm_model"], **{**case["overrides"], **changes}).eval()


def check_outputs(model: nn.Module, io: dict[str, torch.Tensor], large: bool = True) -> None:
    with torch.no_grad():
        torch.testing.assert_close(model(io["input"]), io["logits"], **TOL)
        pre = model.forward_head(model.forward_features(io["input"]), pre_logits=True)
        torch.testing.assert_close(pre, io["pre_logits"], **TOL)
        if large:
            torch.testing.assert_close(model(io["input_large"]), io["logits_large"], **TOL)


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    spec = MANIFEST["cases"][request.param]
    return spec, load_file(str(DATA / spec["state_dict"])), load_file(str(DATA / spec["io"]))


def test_load_state_dict_reproduces_timm(case: tuple) -> None:
    spec, state_dict, io = case
    model = build(spec)
    model.load_state_dict(state_dict)
    check_outputs(model, io)


@pytest.mark.parametrize("container", ["safetensors", "pth_model", "pth_state_dict"])
def test_load_checkpoint_reproduces_timm(case: tuple, container: str, tmp_path: Path) -> None:
    spec, state_dict, io = case
    if container == "safetensors":
        path = DATA / spec["state_dict"]
    elif container == "pth_model":  # DeiT's release layout
        path = tmp_path / "checkpoint.pth"
        torch.save({"model": state_dict, "epoch": 299}, path)
    else:
        path = tmp_path / "checkpoint.pth"
        torch.save({"state_dict": state_dict}, path)
    model = vitrim.create_model(spec["timm_model"], checkpoint=path, **spec["overrides"]).eval()
    check_outputs(model, io)


def test_resampling_at_load_matches_timm_resampling_on_the_fly(case: tuple) -> None:
    spec, _, io = case
    height, width = io["input_large"].shape[-2:]
    # a model built for the large, non-square size: its position embedding is resampled once, when loading
    model = build(spec, img_size=(int(height), int(width)))
    result = vitrim.load_checkpoint(model, DATA / spec["state_dict"])
    patch = model.config.patch_size
    assert result.resampled_pos_embed is not None and result.resampled_pos_embed[1] == (height // patch, width // patch)
    with torch.no_grad():
        torch.testing.assert_close(model(io["input_large"]), io["logits_large"], **TOL)


def test_features_only_model_gives_timm_pre_logits(case: tuple) -> None:
    spec, _, io = case
    model = build(spec, num_classes=0)
    with pytest.warns(UserWarning, match="model has no head"):
        vitrim.load_checkpoint(model, DATA / spec["state_dict"])
    with torch.no_grad():
        torch.testing.assert_close(model(io["input"]), io["pre_logits"], **TOL)
