"""A config.json may leave out what equals transformers' defaults (older ``save_pretrained`` wrote only the
differences: google/siglip-base-patch16-224's vision_config is little more than its model_type). vitrim's table of
those defaults against transformers' own config classes, and a repo whose config omits its activation and
LayerNorm eps still gives transformers' outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vitrim
from vitrim.weights.hf_names import TRANSFORMERS_DEFAULTS

transformers = pytest.importorskip("transformers")
CONFIG_CLASSES = {
    "vit": "ViTConfig",
    "dinov2": "Dinov2Config",
    "dinov2_with_registers": "Dinov2WithRegistersConfig",
    "clip_vision_model": "CLIPVisionConfig",
    "siglip_vision_model": "SiglipVisionConfig",
}


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_the_defaults_are_transformers_own(model_type: str) -> None:
    defaults = getattr(transformers, CONFIG_CLASSES[model_type])()
    table = TRANSFORMERS_DEFAULTS[model_type]
    assert {key: getattr(defaults, key) for key in table} == table


def test_a_siglip_config_that_leaves_out_its_activation_and_eps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32)
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99)
    siglip = transformers.SiglipModel(transformers.SiglipConfig(vision_config=vision, text_config=text)).eval()
    with torch.no_grad():
        for param in siglip.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    siglip.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("hidden_act", "layer_norm_eps", "patch_size", "num_channels"):  # all transformers' defaults
        del config["vision_config"][key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = vitrim.load_model(tmp_path)
    assert (model.config.act_layer, model.config.norm_eps, model.config.patch_size) == ("gelu_tanh", 1e-6, 16)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = siglip.vision_model(pixel_values=x).pooler_output
        assert float((model(x) - expected).abs().max() / expected.abs().max()) <= 1e-5
