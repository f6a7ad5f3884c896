"""The timm-eager reference forward reproduces timm's own outputs (fixtures written by timm 1.0.31)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitrim
from vitrim.bench.reference import check_timm_reference, timm_eager_forward

DATA = Path(__file__).resolve().parents[1] / "data" / "timm"
MANIFEST = json.loads((DATA / "manifest.json").read_text())


@pytest.mark.parametrize("name", sorted(MANIFEST["cases"]))
def test_reference_matches_timm_fixture(name):
    spec = MANIFEST["cases"][name]
    model = vitrim.create_model(spec["timm_model"], **spec["overrides"]).eval()
    model.load_state_dict(load_file(str(DATA / spec["state_dict"])))
    io = load_file(str(DATA / spec["io"]))
    with torch.inference_mode():
        logits = timm_eager_forward(check_timm_reference(model), io["input"])
    torch.testing.assert_close(logits, io["logits"], rtol=1e-5, atol=1e-5)


def test_reference_refuses_what_it_does_not_compute():
    tiny = dict(embed_dim=32, depth=2, num_heads=2, img_size=32, patch_size=8)
    with pytest.raises(ValueError, match="distillation token"):
        check_timm_reference(vitrim.create_model("deit_tiny_distilled_patch16_224", **tiny))
    model = vitrim.create_model("vit_tiny_patch16_224", **tiny)
    with pytest.raises(ValueError, match="img_size"):
        timm_eager_forward(model, torch.randn(1, 3, 64, 64))
    vitrim.reduce.apply(model, "tome", r=2)
    with pytest.raises(ValueError, match="token reducers"):
        check_timm_reference(model)
