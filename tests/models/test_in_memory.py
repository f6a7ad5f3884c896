"""Models already in memory: ``vitrim.from_timm`` and ``vitrim.from_transformers`` give the libraries' own outputs
(1e-5) with their data config, and a vitrim model's ``state_dict()`` loads into timm's model of the same name
(strict), on every family timm has (tests/data/timm_modern, with timm's own weights, plus plain ViT and DeiT)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitrim
from vitrim.models.data_config import DataConfig

timm = pytest.importorskip("timm")

DATA = Path(__file__).parents[1] / "data" / "timm_modern"
CASES = json.loads((DATA / "manifest.json").read_text())["cases"]
PLAIN = {  # timm's plain ViT and DeiT (with its distillation token), tiny, weights perturbed by the test
    "vit_base_patch16_224": dict(img_size=32, depth=1, embed_dim=32, num_heads=2, num_classes=5),
    "deit_tiny_distilled_patch16_224": dict(img_size=32, depth=1, embed_dim=32, num_heads=2, num_classes=5),
}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def timm_model(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """timm's model and its inputs: a fixture family with its stored weights, or a plain one perturbed here."""
    if name in CASES:
        case = CASES[name]
        model = timm.create_model(name, pretrained=False, dynamic_img_size=True, **case["overrides"])
        model.load_state_dict(load_file(str(DATA / case["state_dict"])))
        io = load_file(str(DATA / case["io"]))
        return model.eval(), {"input": io["input"], "input_large": io["input_large"]}
    model = timm.create_model(name, pretrained=False, dynamic_img_size=True, **PLAIN[name])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    images = torch.randn(2, 3, 32, 32, generator=generator)
    return model.eval(), {"input": images, "input_large": torch.randn(2, 3, 48, 64, generator=generator)}


@pytest.mark.parametrize("name", sorted(CASES) + sorted(PLAIN))
def test_from_timm_gives_timm_s_outputs_and_its_state_dict_loads_back_into_timm(name: str) -> None:
    theirs, inputs = timm_model(name)
    model = vitrim.from_timm(theirs)
    assert not model.training
    with torch.no_grad():
        for x in inputs.values():  # input_large: timm's resampled position embedding / RoPE at another size
            assert relative(model(x), theirs(x)) <= 1e-5
        assert relative(model.forward_features(inputs["input"]), theirs.forward_features(inputs["input"])) <= 1e-5
    # timm's data config, but sized for the model (timm keeps the pretrained 224 even for a model built smaller)
    expected = {**timm.data.resolve_data_config({}, model=theirs), "input_size": (3, *theirs.patch_embed.img_size)}
    assert {key: getattr(model.data_config, key) for key in expected} == expected
    # the other way: vitrim's state dict into a fresh timm model of the same name, strict
    fresh = timm.create_model(name, pretrained=False, **(CASES[name]["overrides"] if name in CASES else PLAIN[name]))
    fresh.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(inputs["input"]), theirs(inputs["input"]), rtol=0, atol=1e-6)


def test_a_reducer_goes_onto_the_model_a_user_holds_in_one_line() -> None:
    theirs, inputs = timm_model("deit3_small_patch16_224")
    model = vitrim.reduce.apply(vitrim.from_timm(theirs.train()), "tome", r=2)
    assert model.training  # the mode of the model given
    out = model.eval().forward_detailed(inputs["input"])
    assert out.logits.shape == (2, 4) and out.tokens.shape[1] < inputs["input"].shape[-1] ** 2 // 256 + 1


def test_from_timm_refuses_what_it_cannot_build() -> None:
    with pytest.raises(TypeError, match=r"from_timm takes a model made by timm\.create_model"):
        vitrim.from_timm(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="timm model 'resnet18' is timm's 'resnet18', which vitrim does not build"):
        vitrim.from_timm(timm.create_model("resnet18", pretrained=False, num_classes=2))


# -- transformers ---------------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
VISION = dict(SMALL, intermediate_size=64, image_size=32, patch_size=16)
TEXT = dict(SMALL, intermediate_size=64, vocab_size=99, max_position_embeddings=16)
HF = {
    "vit": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(**VISION, num_labels=3)),
    "dinov2": lambda: transformers.Dinov2Model(transformers.Dinov2Config(**SMALL, image_size=28, patch_size=14)),
    "dinov2_with_registers": lambda: transformers.Dinov2WithRegistersModel(
        transformers.Dinov2WithRegistersConfig(**SMALL, image_size=28, patch_size=14, num_register_tokens=4)
    ),
    "clip": lambda: transformers.CLIPModel(
        transformers.CLIPConfig(vision_config=VISION, text_config=TEXT, projection_dim=24)
    ),
    "siglip": lambda: transformers.SiglipModel(transformers.SiglipConfig(vision_config=VISION, text_config=TEXT)),
}


def hf_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = HF[kind]()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def hf_features(kind: str, hf: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the vitrim model returns for ``kind``: logits, the [CLS] features or the pooled tower output."""
    if kind == "vit":
        return hf(pixel_values=x).logits
    if kind in ("clip", "siglip"):
        return hf.vision_model(pixel_values=x).pooler_output
    return hf(pixel_values=x).pooler_output


@pytest.mark.parametrize("kind", sorted(HF))
def test_from_transformers_gives_the_library_s_outputs(kind: str) -> None:
    hf = hf_model(kind)
    model = vitrim.from_transformers(hf)
    size = 28 if kind.startswith("dinov2") else 32
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative(model(x), hf_features(kind, hf, x)) <= 1e-5
    assert model.data_config.input_size == (3, size, size)


def test_clip_s_projection_and_the_data_config_of_a_given_image_processor() -> None:
    hf = hf_model("clip")
    processor = {"size": {"shortest_edge": 36}, "crop_size": {"height": 32, "width": 32}, "do_center_crop": True}
    model = vitrim.from_transformers(hf, projection=True, image_processor={**processor, "resample": 2})
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        features = hf.get_image_features(pixel_values=x)
        features = getattr(features, "pooler_output", features)  # transformers 5 wraps it in an output object
        assert relative(model(x), features) <= 1e-5
    assert dataclasses.replace(model.data_config, mean=(0.0,) * 3, std=(1.0,) * 3) == DataConfig(
        input_size=(3, 32, 32), mean=(0.0,) * 3, std=(1.0,) * 3, interpolation="bilinear", crop_pct=32 / 36
    )


def test_from_transformers_refuses_what_it_cannot_build() -> None:
    with pytest.raises(ValueError, match=r"projection=True needs CLIP's visual projection.*this is dinov2"):
        vitrim.from_transformers(hf_model("dinov2"), projection=True)
    bert = transformers.BertModel(transformers.BertConfig(**SMALL, intermediate_size=64, vocab_size=50))
    with pytest.raises(ValueError, match=r"transformers model BertModel: config.json has model_type 'bert'"):
        vitrim.from_transformers(bert)
    with pytest.raises(TypeError, match="from_transformers takes a transformers model"):
        vitrim.from_transformers(torch.nn.Linear(2, 2))
