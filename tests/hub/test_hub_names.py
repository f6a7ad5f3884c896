"""Loading by name through huggingface_hub, as a user will, with no network: the tests lay out the cache that
huggingface_hub reads (tests/hub/hub_cache.py) with models that timm and transformers made and saved here, set
``HF_HUB_OFFLINE=1`` and ``HF_HOME``, and load by name; outputs equal the libraries' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hub_cache import add_folder, add_repo

import vitrim
from vitrim.cli import main
from vitrim.weights.checkpoint import CheckpointMismatchError

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

TIMM_TINY = dict(depth=1, embed_dim=32, num_heads=2)
TOL = dict(rtol=0, atol=1e-5)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its initialisation (no LayerNorm at 1/0, no zero bias hides a swap)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def pixels(size: tuple[int, int], seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache under a fresh HF_HOME, offline: what is not laid out here cannot be had."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def timm_folder(tmp: Path, name: str, seed: int = 0, **kwargs: object) -> tuple[torch.nn.Module, Path]:
    """A tiny timm model with perturbed weights, saved as timm pushes to the hub (config.json + model.safetensors)."""
    model = perturbed(timm.create_model(name, pretrained=False, **kwargs), seed)
    folder = tmp / f"{name}-{seed}"
    timm.models.save_for_hf(model, folder, safe_serialization=True)
    return model, folder


# -- timm's layout ------------------------------------------------------------------------------------------------


def test_create_model_pretrained_reads_timm_s_repo_for_name_and_tag(cache: Path, tmp_path: Path) -> None:
    theirs, folder = timm_folder(tmp_path, "vit_base_patch16_224.augreg2_in21k_ft_in1k", img_size=32, **TIMM_TINY)
    add_folder(cache, "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k", folder)
    x = pixels((32, 32))
    for name in ("vit_base_patch16_224.augreg2_in21k_ft_in1k", "vit_base_patch16_224"):  # the default tag
        model = vitrim.create_model(name, pretrained=True, img_size=32, **TIMM_TINY).eval()
        assert model.config.num_classes == 1000  # the weights' classes
        with torch.no_grad():
            torch.testing.assert_close(model(x), theirs(x), **TOL)
    expected = timm.data.resolve_data_config({}, model=theirs)
    assert {k: getattr(model.data_config, k) for k in expected} == {**expected, "input_size": (3, 32, 32)}
    with pytest.warns(UserWarning, match="the checkpoint's head has 1000 classes, the model's 7"):
        fine_tune = vitrim.create_model(
            "vit_base_patch16_224", pretrained=True, num_classes=7, img_size=32, **TIMM_TINY
        )
    assert fine_tune.config.num_classes == 7


def test_load_model_reads_a_timm_repo_with_its_model_args_and_data_config(cache: Path, tmp_path: Path) -> None:
    theirs, folder = timm_folder(
        tmp_path,
        "vit_small_patch14_reg4_dinov2.lvd142m",
        img_size=28,
        num_classes=0,
        dynamic_img_size=True,
        **TIMM_TINY,
    )
    add_folder(cache, "timm/vit_small_patch14_reg4_dinov2.lvd142m", folder)
    model = vitrim.load_model("hf-hub:timm/vit_small_patch14_reg4_dinov2.lvd142m")
    assert not model.training and model.config.reg_tokens == 4 and model.config.depth == 1
    assert model.data_config == vitrim.models.data_config.DataConfig.from_timm(theirs.pretrained_cfg).for_input(
        3, (28, 28)
    )
    with torch.no_grad():
        for size in ((28, 28), (42, 56)):  # the second resamples the position embedding as timm does
            assert relative(model(pixels(size)), theirs(pixels(size))) <= 1e-5
    reduced = vitrim.create_model("hf-hub:timm/vit_small_patch14_reg4_dinov2.lvd142m", reducer="tome", r=1)
    assert reduced(pixels((28, 28))).shape == (2, 32)


def test_revisions_branches_tags_and_commits(cache: Path, tmp_path: Path) -> None:
    first, folder1 = timm_folder(tmp_path, "deit_tiny_patch16_224", seed=1, img_size=32, **TIMM_TINY)
    second, folder2 = timm_folder(tmp_path, "deit_tiny_patch16_224", seed=2, img_size=32, **TIMM_TINY)
    add_folder(cache, "someone/deit", folder1)
    commit = add_folder(cache, "someone/deit", folder2, revision="v2")
    x = pixels((32, 32))
    with torch.no_grad():
        torch.testing.assert_close(vitrim.load_model("hf-hub:someone/deit")(x), first(x), **TOL)
        for revision in ("v2", commit):
            torch.testing.assert_close(vitrim.load_model(f"hf-hub:someone/deit@{revision}")(x), second(x), **TOL)
        # a hub repo's weights as the checkpoint of a registered model
        model = vitrim.create_model(
            "deit_tiny_patch16_224", checkpoint="hf-hub:someone/deit@v2", img_size=32, **TIMM_TINY
        )
        torch.testing.assert_close(model.eval()(x), second(x), **TOL)
    report = huggingface_hub.scan_cache_dir(cache)  # huggingface_hub's own reader finds the layout sound
    assert not report.warnings and {r.repo_id for r in report.repos} == {"someone/deit"}


def test_an_older_timm_repo_with_a_flat_config(cache: Path, tmp_path: Path) -> None:
    theirs, folder = timm_folder(tmp_path, "deit_tiny_patch16_224", img_size=32, **TIMM_TINY)
    config = json.loads((folder / "config.json").read_text())
    flat = {"architecture": config["architecture"], "num_classes": 1000, **config["pretrained_cfg"], "mean": [0.1] * 3}
    (folder / "config.json").write_text(json.dumps(flat))  # timm's first hub layout: no pretrained_cfg, no model_args
    add_folder(cache, "someone/old-deit", folder)
    model = vitrim.load_model("hf-hub:someone/old-deit", img_size=32, **TIMM_TINY)
    assert model.data_config.mean == (0.1, 0.1, 0.1)
    with torch.no_grad():
        torch.testing.assert_close(model(pixels((32, 32))), theirs(pixels((32, 32))), **TOL)


# -- transformers' layout ------------------------------------------------------------------------------------------

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
VISION = dict(SMALL, intermediate_size=64, image_size=32, patch_size=16)
TEXT = dict(SMALL, intermediate_size=64, vocab_size=99, max_position_embeddings=16)
# the preprocessor_config.json of the official repos (openai/clip-vit-base-patch16, google/siglip-base-patch16-224)
CLIP_PROCESSOR = {
    "crop_size": 32,
    "do_center_crop": True,
    "do_normalize": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "size": 32,
}
SIGLIP_PROCESSOR = {
    "do_normalize": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "size": {"height": 32, "width": 32},
}


def hf_repo(cache: Path, tmp: Path, repo_id: str, model: torch.nn.Module, processor: dict | None = None) -> None:
    folder = tmp / repo_id.replace("/", "--")
    model.save_pretrained(folder)
    if processor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    add_folder(cache, repo_id, folder)


def test_full_clip_repo_gives_its_vision_tower_and_projection(cache: Path, tmp_path: Path) -> None:
    config = transformers.CLIPConfig(vision_config=VISION, text_config=TEXT, projection_dim=24)
    clip = perturbed(transformers.CLIPModel(config))
    hf_repo(cache, tmp_path, "openai/clip-vit-base-patch16", clip, CLIP_PROCESSOR)
    x = pixels((32, 32))
    tower = vitrim.load_model("hf-hub:openai/clip-vit-base-patch16")
    projected = vitrim.load_model("hf-hub:openai/clip-vit-base-patch16", projection=True)
    with torch.no_grad():
        pooled = clip.vision_model(pixel_values=x).pooler_output
        assert relative(tower(x), pooled) <= 1e-5
        assert relative(projected(x), clip.visual_projection(pooled)) <= 1e-5  # = CLIPModel.get_image_features
        assert relative(projected.forward_head(projected.forward_features(x), pre_logits=True), pooled) <= 1e-5
    assert projected.config.num_classes == 24 and tower.config.num_classes == 0
    data = tower.data_config
    assert (data.crop_mode, data.crop_pct, data.interpolation) == ("center", 1.0, "bicubic")
    assert data.mean == tuple(CLIP_PROCESSOR["image_mean"]) and data.input_size == (3, 32, 32)


def test_full_siglip_repo_gives_its_attention_pooled_tower(cache: Path, tmp_path: Path) -> None:
    config = transformers.SiglipConfig(vision_config=VISION, text_config=TEXT)
    siglip = perturbed(transformers.SiglipModel(config))
    hf_repo(cache, tmp_path, "google/siglip-base-patch16-224", siglip, SIGLIP_PROCESSOR)
    x = pixels((32, 32))
    model = vitrim.load_model("hf-hub:google/siglip-base-patch16-224", projection=True)  # nothing to add for SigLIP
    with torch.no_grad():
        assert relative(model(x), siglip.vision_model(pixel_values=x).pooler_output) <= 1e-5
    assert (model.data_config.crop_mode, model.data_config.crop_pct) == ("squash", 1.0)


@pytest.mark.parametrize("kind", ["vit", "dinov2_with_registers"])
def test_transformers_vision_repos_without_a_processor_file(kind: str, cache: Path, tmp_path: Path) -> None:
    if kind == "vit":
        hf = transformers.ViTModel(transformers.ViTConfig(**VISION), add_pooling_layer=False)
    else:
        hf = transformers.Dinov2WithRegistersModel(
            transformers.Dinov2WithRegistersConfig(**SMALL, image_size=28, patch_size=14, num_register_tokens=2)
        )
    hf = perturbed(hf)
    hf_repo(cache, tmp_path, f"org/{kind}", hf)
    model = vitrim.load_model(f"hf-hub:org/{kind}")
    size = hf.config.image_size
    with torch.no_grad():
        assert (
            relative(model(pixels((size, size))), hf(pixel_values=pixels((size, size))).last_hidden_state[:, 0]) <= 1e-5
        )
    default = "squash" if kind == "vit" else "center"  # what google/vit-* and facebook/dinov2-* preprocess with
    assert model.data_config.crop_mode == default


def test_a_dinov2_repo_keeps_its_processor_s_size(cache: Path, tmp_path: Path) -> None:
    # facebook/dinov2-*: a 518 grid, and a processor that resizes the shortest edge to 256 and crops 224
    hf = perturbed(transformers.Dinov2Model(transformers.Dinov2Config(**SMALL, image_size=42, patch_size=14)))
    processor = {"size": {"shortest_edge": 32}, "crop_size": {"height": 28, "width": 28}, "do_center_crop": True}
    hf_repo(cache, tmp_path, "facebook/dinov2-small", hf, {**processor, "resample": 3})
    model = vitrim.load_model("hf-hub:facebook/dinov2-small")
    data = model.data_config
    assert (data.input_size, data.crop_pct, data.crop_mode, data.interpolation) == (
        (3, 28, 28),
        0.875,
        "center",
        "bicubic",
    )
    x = pixels((28, 28))  # what the processor makes: the position embedding is resampled down, as transformers does
    with torch.no_grad():
        assert relative(model(x), hf(pixel_values=x).pooler_output) <= 1e-5


# -- what goes wrong: one clear line each --------------------------------------------------------------------------


def test_a_name_missing_from_the_cache_offline(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError, match=r"hf-hub:nobody/nothing: config.json is not in the Hugging Face cache"):
        vitrim.load_model("hf-hub:nobody/nothing")
    with pytest.raises(FileNotFoundError, match=r"timm/deit_tiny_patch16_224.fb_in1k.*HF_HUB_OFFLINE=1 forbids"):
        vitrim.create_model("deit_tiny_patch16_224", pretrained=True)
    assert main(["eval", "hf-hub:nobody/nothing", "--data", "digits"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitrim: error: hf-hub:nobody/nothing: config.json is not in the Hugging Face cache")
    assert err.count("\n") == 1


def test_a_family_vitrim_does_not_have(cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    add_repo(cache, "org/bert", {"config.json": b'{"model_type": "bert"}', "model.safetensors": tmp_weights(tmp_path)})
    with pytest.raises(ValueError, match=r"hf-hub:org/bert: config.json has model_type 'bert'; vitrim reads"):
        vitrim.load_model("hf-hub:org/bert")
    _, folder = timm_folder(tmp_path, "resnet18", num_classes=3)
    add_folder(cache, "timm/resnet18.a1_in1k", folder)
    assert main(["viz", "attention", "--checkpoint", "hf-hub:timm/resnet18.a1_in1k", "--digits", "0", "--out",
                 str(tmp_path / "a.png")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err == (
        "vitrim: error: hf-hub:timm/resnet18.a1_in1k is timm's 'resnet18', which vitrim does not build; vitrim builds "
        "the Vision Transformers of vitrim.list_models() (timm's names)\n"
    )


def tmp_weights(tmp: Path) -> Path:
    from safetensors.torch import save_file

    save_file({"embeddings.word_embeddings.weight": torch.zeros(4, 2)}, str(tmp / "bert.safetensors"))
    return tmp / "bert.safetensors"


def test_a_config_that_disagrees_with_its_weights(cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, folder = timm_folder(tmp_path, "deit_tiny_patch16_224", img_size=32, **TIMM_TINY)
    config = json.loads((folder / "config.json").read_text())
    config["model_args"]["depth"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    add_folder(cache, "someone/deit-broken", folder)
    with pytest.raises(
        CheckpointMismatchError, match=r"hf-hub:someone/deit-broken: its config and its weights disagree"
    ):
        vitrim.load_model("hf-hub:someone/deit-broken")
    assert main(["export", "hf-hub:someone/deit-broken", "--onnx", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitrim: error: hf-hub:someone/deit-broken: its config and its weights disagree: ")
    assert "12 missing key(s): blocks.1." in err and err.count("\n") == 1


def test_hub_names_are_checked_before_any_download() -> None:
    for bad in ("hf-hub:no-slash", "hf-hub:a/b/c", "hf-hub:org/name@"):
        with pytest.raises(ValueError, match="must be 'hf-hub:ORG/NAME' or 'hf-hub:ORG/NAME@REVISION'"):
            vitrim.load_model(bad)
    with pytest.raises(ValueError, match="no pretrained weights are known for 'cnn_small'"):
        vitrim.create_model("cnn_small", pretrained=True)


def test_the_cli_takes_hub_names_wherever_it_takes_a_checkpoint(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, folder = timm_folder(tmp_path, "deit_tiny_patch16_224", img_size=32, num_classes=10, **TIMM_TINY)
    add_folder(cache, "someone/digits-deit", folder)
    name = "hf-hub:someone/digits-deit"
    assert main(["eval", name, "--data", "digits", "--batch-size", "128"]) == 0
    assert capsys.readouterr().out.startswith("VisionTransformer on digits (test, ")
    speed = ["--batch-size", "2", "--repeats", "1", "--warmup", "0", "--latency-repeats", "0", "--no-memory"]
    assert main(["bench", "models", f"{name},{name}[reducer=tome:r=2]", *speed]) == 0
    assert "someone/digits-deit tome:r=2" in capsys.readouterr().out
    image = tmp_path / "photo.png"
    pytest.importorskip("PIL.Image").new("RGB", (50, 40), (200, 30, 30)).save(image)
    out = tmp_path / "rollout.png"
    assert main(["viz", "rollout", "--checkpoint", name, "--image", str(image), "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def test_the_cache_is_where_the_environment_says_now(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from vitrim.weights.hub import cache_dir

    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    assert cache_dir() is None  # huggingface_hub's own default
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "huggingface" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert cache_dir() == str(tmp_path / "home" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == str(tmp_path / "cache")
