"""Hugging Face ViT checkpoints load into vitrim and give Hugging Face's own numbers (transformers runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vitrim

transformers = pytest.importorskip("transformers")

SIZES = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
)
VITRIM_SIZES = dict(embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, img_size=32, patch_size=8)
TOL = dict(rtol=1e-4, atol=1e-4)


def hf_model(cls_name: str = "ViTForImageClassification", seed: int = 0, **config: object) -> torch.nn.Module:
    """A tiny HF ViT whose every parameter is random (HF zeroes biases and sets LayerNorm to 1/0 at init, which would
    hide a swapped bias or norm)."""
    torch.manual_seed(seed)
    hf_config = transformers.ViTConfig(**{**SIZES, "num_labels": 3, **config})
    hf_config._attn_implementation = "eager"  # so that output_attentions returns the weights
    kwargs = {"add_pooling_layer": config.pop("add_pooling_layer", True)} if cls_name == "ViTModel" else {}
    model = getattr(transformers, cls_name)(hf_config, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def pixels(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def classifier() -> torch.nn.Module:
    return hf_model()


@pytest.fixture(scope="module")
def saved(classifier: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf_vit")
    classifier.save_pretrained(directory)
    return directory


def test_save_pretrained_layout_is_what_we_convert(saved: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "vit.encoder.layer.0.attention.attention.query.weight" in keys  # the classic layout, on disk
    assert json.loads((saved / "config.json").read_text())["layer_norm_eps"] == 1e-12


def test_load_model_from_directory_matches_hf(classifier: torch.nn.Module, saved: Path) -> None:
    model = vitrim.load_model(saved)
    assert model.config == vitrim.ViTConfig(**VITRIM_SIZES, num_classes=3, norm_eps=1e-12, pos_embed_antialias=False)
    with torch.no_grad():
        torch.testing.assert_close(model(pixels()), classifier(pixel_values=pixels()).logits, **TOL)


def test_attention_maps_match_hf(classifier: torch.nn.Module, saved: Path) -> None:
    model = vitrim.load_model(saved)
    with torch.no_grad():
        ours = model.forward_detailed(pixels(), need_weights=True).attentions
        theirs = classifier(pixel_values=pixels(), output_attentions=True).attentions
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL)


def test_create_model_with_hf_checkpoint(classifier: torch.nn.Module, saved: Path) -> None:
    model = vitrim.create_model("vit_base_patch16_224", **VITRIM_SIZES, num_classes=3, norm_eps=1e-12, checkpoint=saved)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(pixels()), classifier(pixel_values=pixels()).logits, **TOL)
    with pytest.warns(UserWarning, match="layer_norm_eps=1e-12, the model uses norm_eps=1e-06"):
        vitrim.create_model("vit_base_patch16_224", **VITRIM_SIZES, num_classes=3, checkpoint=saved)


def test_weights_file_next_to_config_and_in_memory_bin(
    classifier: torch.nn.Module, saved: Path, tmp_path: Path
) -> None:
    expected = classifier(pixel_values=pixels()).logits.detach()
    with torch.no_grad():
        torch.testing.assert_close(vitrim.load_model(saved / "model.safetensors")(pixels()), expected, **TOL)
    # torch.save(state_dict()) keeps transformers 5's in-memory names: vit.layers.N.attention.q_proj, mlp.fc1, …
    state_dict = classifier.state_dict()
    assert any(".attention.q_proj." in key for key in state_dict)
    torch.save(state_dict, tmp_path / "pytorch_model.bin")
    model = vitrim.create_model(
        "vit_base_patch16_224", **VITRIM_SIZES, num_classes=3, norm_eps=1e-12, checkpoint=tmp_path / "pytorch_model.bin"
    ).eval()
    assert vitrim.load_checkpoint(model, tmp_path / "pytorch_model.bin").format == "huggingface"
    with torch.no_grad():
        torch.testing.assert_close(model(pixels()), expected, **TOL)


def test_sharded_save_pretrained(classifier: torch.nn.Module, tmp_path: Path) -> None:
    classifier.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(
            vitrim.load_model(tmp_path)(pixels()), classifier(pixel_values=pixels()).logits, **TOL
        )


@pytest.mark.parametrize("pooler", [True, False])
def test_vit_model_without_classifier_gives_the_cls_features(pooler: bool, tmp_path: Path) -> None:
    hf = hf_model("ViTModel", add_pooling_layer=pooler)
    hf.save_pretrained(tmp_path)
    model = vitrim.load_model(tmp_path)  # the pooler (dense + tanh) is ignored: vitrim returns the [CLS] features
    assert model.config.num_classes == 0
    with torch.no_grad():
        torch.testing.assert_close(model(pixels()), hf(pixel_values=pixels()).last_hidden_state[:, 0], **TOL)
    result = vitrim.load_checkpoint(model, tmp_path)
    assert sorted(result.ignored) == (["pooler.dense.bias", "pooler.dense.weight"] if pooler else [])


def test_backbone_into_a_classifier_gets_a_fresh_head(tmp_path: Path) -> None:
    hf = hf_model("ViTModel")
    hf.save_pretrained(tmp_path)
    model = vitrim.create_model("vit_base_patch16_224", **VITRIM_SIZES, num_classes=4, norm_eps=1e-12)
    with pytest.warns(UserWarning, match="no classifier head; the model's 4-class head is freshly initialised"):
        result = vitrim.load_checkpoint(model, tmp_path)
    assert result.fresh == ["head.weight", "head.bias"]


def test_no_qkv_bias(tmp_path: Path) -> None:
    hf = hf_model(qkv_bias=False)
    hf.save_pretrained(tmp_path)
    model = vitrim.load_model(tmp_path)
    assert model.config.qkv_bias is False
    with torch.no_grad():
        torch.testing.assert_close(model(pixels()), hf(pixel_values=pixels()).logits, **TOL)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "bert"}, "model_type 'bert'; vitrim reads Hugging Face ViT"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        (
            {"intermediate_size": 48},
            r"6 shape mismatch\(es\): blocks.0.mlp.fc1.weight checkpoint \[64, 32\] vs model \[48, 32\]",
        ),
    ],
)
def test_configs_vitrim_cannot_build_are_refused(saved: Path, tmp_path: Path, change: dict, message: str) -> None:
    (tmp_path / "model.safetensors").write_bytes((saved / "model.safetensors").read_bytes())
    config = {**json.loads((saved / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        vitrim.load_model(tmp_path)
