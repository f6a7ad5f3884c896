"""The families people run today, against the libraries' own outputs: timm 1.0.31 fixtures (tests/data/timm_modern,
every parameter perturbed) and Hugging Face models built here with transformers; RoPE by hand; registers pooled never.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitrim
from vitrim.attention.rotary import apply_rotary, rotary_table
from vitrim.models.data_config import DINOV2, OPENAI_CLIP_MEAN

DATA = Path(__file__).parents[1] / "data" / "timm_modern"
CASES = json.loads((DATA / "manifest.json").read_text())["cases"]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", sorted(CASES))
def test_timm_state_dicts_give_timm_outputs(name: str) -> None:
    case = CASES[name]
    io = load_file(str(DATA / case["io"]))
    model = vitrim.create_model(name, checkpoint=DATA / case["state_dict"], **case["overrides"]).eval()
    assert model.num_prefix == case["num_prefix_tokens"] and model.config.global_pool == case["global_pool"]
    with torch.no_grad():
        tokens = model.forward_features(io["input"])
        assert relative(tokens, io["tokens"]) <= 1e-5
        assert relative(model.forward_head(tokens, pre_logits=True), io["pre_logits"]) <= 1e-5
        assert relative(model(io["input"]), io["logits"]) <= 1e-5
        assert relative(model(io["input_large"]), io["logits_large"]) <= 1e-5  # resampled position / RoPE tables


@pytest.mark.parametrize("name", sorted(CASES))
def test_save_and_load_model_round_trip_every_family(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    io = load_file(str(DATA / case["io"]))
    model = vitrim.create_model(name, checkpoint=DATA / case["state_dict"], **case["overrides"]).eval()
    loaded = vitrim.load_model(vitrim.save_checkpoint(model, tmp_path / "m.safetensors"))
    with torch.no_grad():
        assert torch.equal(loaded(io["input_large"]), model(io["input_large"]))


def test_rotary_embedding_by_hand_on_a_2x2_grid() -> None:
    """head width 8: bands ω = (1, 1/100); a patch at (y, x) turns channel pairs by y, y/100, x, x/100."""
    table = rotary_table((2, 2), 8)
    assert table.shape == (4, 16)
    x = torch.randn(4, 8, dtype=torch.float64)
    rotated = apply_rotary(x, table.double())
    for p, (y, xx) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        for pair, angle in enumerate([y * 1.0, y / 100, xx * 1.0, xx / 100]):
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[p, 2 * pair], x[p, 2 * pair + 1]
            expected = torch.stack([a * c - b * s, b * c + a * s])
            torch.testing.assert_close(rotated[p, 2 * pair : 2 * pair + 2], expected, rtol=1e-6, atol=1e-7)
    scaled = rotary_table((2, 2), 8, ref_grid=(4, 4))  # EVA's ref_feat_shape: row 1 counts as row 2 of a 4x4 grid
    torch.testing.assert_close(scaled[3], rotary_table((4, 4), 8)[2 * 4 + 2])


def test_registers_are_never_pooled_into_the_mean() -> None:
    torch.manual_seed(0)
    model = vitrim.create_model(
        "vit_small_patch14_reg4_dinov2", embed_dim=32, depth=1, num_heads=2, img_size=28, global_pool="avg"
    ).eval()
    tokens = torch.randn(2, 5 + 4, 32)  # [CLS], 4 registers, 2x2 patches
    poisoned = tokens.clone()
    poisoned[:, :5] = 1e6  # prefix tokens: [CLS] and the registers
    with torch.no_grad():
        pooled = model.forward_head(tokens, pre_logits=True)
        assert torch.equal(model.forward_head(poisoned, pre_logits=True), pooled)
        torch.testing.assert_close(pooled, model.fc_norm(tokens[:, 5:].mean(1)))


def test_data_configs_follow_the_weights_and_the_model_size() -> None:
    clip = vitrim.create_model("vit_base_patch16_clip_224", depth=1, embed_dim=32, num_heads=2)
    assert clip.data_config.mean == OPENAI_CLIP_MEAN and clip.data_config.input_size == (3, 224, 224)
    dino = vitrim.create_model("vit_small_patch14_dinov2", depth=1, embed_dim=32, num_heads=2)
    assert dino.config.img_size == (518, 518) and dino.data_config.crop_pct == DINOV2.crop_pct
    grey = vitrim.create_model("deit_tiny_patch16_224", depth=1, in_chans=1, img_size=32)
    assert grey.data_config.input_size == (1, 32, 32) and len(grey.data_config.mean) == 1


# -- Hugging Face ------------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
HF_MODELS = {
    "dinov2": lambda: transformers.Dinov2Model(transformers.Dinov2Config(**SMALL, image_size=28, patch_size=14)),
    "dinov2_with_registers": lambda: transformers.Dinov2WithRegistersModel(
        transformers.Dinov2WithRegistersConfig(**SMALL, image_size=28, patch_size=14, num_register_tokens=4)
    ),
    "clip": lambda: transformers.CLIPVisionModel(
        transformers.CLIPVisionConfig(**SMALL, intermediate_size=64, image_size=32, patch_size=16)
    ),
    "siglip": lambda: transformers.SiglipVisionModel(
        transformers.SiglipVisionConfig(**SMALL, intermediate_size=64, image_size=32, patch_size=16)
    ),
}


@pytest.mark.parametrize("kind", sorted(HF_MODELS))
def test_hugging_face_directories_give_the_pooler_output(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = HF_MODELS[kind]().eval()
    with torch.no_grad():  # perturb every parameter: no LayerNorm left at 1/0, no layer scale at its init
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path)
    size = hf.config.image_size
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    model = vitrim.load_model(tmp_path)
    with torch.no_grad():
        expected = hf(pixel_values=x).pooler_output
        ours = model.forward_head(model.forward_features(x), pre_logits=True)
    assert relative(ours, expected) <= 1e-5


def test_an_unsupported_hugging_face_model_names_its_type(tmp_path: Path) -> None:
    hf = HF_MODELS["clip"]()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "beit"}))
    with pytest.raises(ValueError, match=r"model_type 'beit'.*'dinov2_with_registers'.*'siglip_vision_model'"):
        vitrim.load_model(tmp_path)
