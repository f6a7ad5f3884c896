"""apply / remove / create_model(reducer=...): identity settings, checkpoints from timm and HF, stacking, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reduce_models import images, tiny
from safetensors.torch import load_file

import vitrim
from vitrim.reduce import EViT, Reducer, TokenState, ToMe, TopK, get_reducer, list_reducers, parse_spec

TIMM = Path(__file__).parents[1] / "data" / "timm"
# every registered reducer, with the settings it declares: a new reducer file is swept without editing this test
SETTINGS = [(name, get_reducer(name).example_options) for name in list_reducers()]
IDENTITY = [(name, get_reducer(name).identity_options) for name in list_reducers()]


@pytest.mark.parametrize(("name", "options"), [*IDENTITY, ("tome", {"r": [0, 0, 0, 0]})])
@pytest.mark.parametrize("distilled", [False, True])
def test_identity_settings_give_the_dense_outputs(name: str, options: dict[str, object], distilled: bool) -> None:
    model = tiny(distilled=distilled)
    x = images()
    with torch.no_grad():
        dense = model(x)
        vitrim.reduce.apply(model, name, **options)
        out = model.forward_detailed(x)
    torch.testing.assert_close(out.logits, dense, rtol=0, atol=1e-6)
    assert out.tokens.shape[1] == 16 + (2 if distilled else 1)
    assert out.token_sizes is None
    assert all(torch.equal(kept, torch.arange(16).expand(2, 16)) for kept in out.kept_indices)  # nothing dropped


def test_on_timm_weights_identity_matches_timm_and_reduction_runs() -> None:
    manifest = json.loads((TIMM / "manifest.json").read_text())["cases"]["vit_tiny_depth2_img64"]
    io = load_file(str(TIMM / manifest["io"]))
    model = vitrim.create_model("vit_tiny_patch16_224", **manifest["overrides"])
    vitrim.load_checkpoint(model, TIMM / manifest["state_dict"])
    model.eval()
    with torch.no_grad():
        vitrim.reduce.apply(model, "evit", keep_rate=1.0, layers=(0, 1))
        torch.testing.assert_close(model(io["input"]), io["logits"], rtol=0, atol=1e-5)  # timm's own output
        vitrim.reduce.remove(model)
        vitrim.reduce.apply(model, "tome", r=4)
        out = model.forward_detailed(io["input_large"], need_weights=True)  # 8×6 grid: 48 patches
    assert [a.shape[-1] for a in out.attentions] == [49, 45]
    assert out.patch_to_token[-1].shape == (2, 48)


def test_on_hugging_face_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    cfg = transformers.ViTConfig(**sizes, image_size=32, patch_size=8, num_labels=5)
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(cfg).eval()
    hf.save_pretrained(tmp_path)
    x = images()
    with torch.no_grad():
        expected = hf(pixel_values=x).logits
        model = vitrim.reduce.apply(vitrim.load_model(tmp_path).eval(), "tome", r=0)
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-5)
        vitrim.reduce.remove(model)
        out = vitrim.reduce.apply(model, "tome", r=5).forward_detailed(x)
    assert out.tokens.shape[1] == 17 - 5 - 5 and torch.isfinite(out.logits).all()


@pytest.mark.parametrize(("name", "options"), SETTINGS)
def test_remove_restores_the_dense_model(name: str, options: dict[str, object]) -> None:
    model = tiny()
    x = images()
    with torch.no_grad():
        dense = model(x)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        reduced = vitrim.reduce.apply(model, name, **options)(x)
        added = {k.split(".")[0] for k in model.state_dict().keys() - state.keys()}
        assert added == set(get_reducer(name).adds_modules)  # only a learned reducer adds (its declared) modules
        assert not torch.allclose(reduced, dense, atol=1e-6)
        assert vitrim.reduce.remove(model) is model
        assert torch.equal(model(x), dense)
        assert model.state_dict().keys() == state.keys()  # remove took them off again
    assert all(block.reducer is None for block in model.blocks)


def test_reducers_stack_with_need_weights() -> None:
    model = vitrim.reduce.apply(tiny(), "tome", r=[2, 0, 4, 0])
    vitrim.reduce.apply(model, "evit", keep_rate=0.5, layers=(1,))
    vitrim.reduce.apply(model, "topk", keep_rate=0.5, layers=(3,))
    x = images()
    with torch.no_grad():
        plain = model.forward_detailed(x)
        detailed = model.forward_detailed(x, need_weights=True)
    # 17 -> ToMe 2 -> 15 -> EViT keep 7 + fused -> 9 -> ToMe 4 -> 5 -> top-k keep 2 -> 3
    assert [tuple(a.shape) for a in detailed.attentions] == [(2, 2, n, n) for n in (17, 15, 9, 5)]
    assert detailed.tokens.shape[1] == 3
    torch.testing.assert_close(detailed.logits, plain.logits, rtol=0, atol=1e-6)
    for a in detailed.attentions:
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]))
    assert len(detailed.patch_to_token) == 4 and len(detailed.kept_indices) == 2


@pytest.mark.parametrize(("name", "options"), SETTINGS)
def test_batch_of_one_gives_the_same_logits_as_in_a_batch(name: str, options: dict[str, object]) -> None:
    model = vitrim.reduce.apply(tiny(), name, **options)
    x = images(batch=3)
    with torch.no_grad():
        batched = model(x)
        single = torch.cat([model(x[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(single, batched, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("name", "options"), SETTINGS)
@pytest.mark.parametrize("batch", [1, 3])
def test_plain_forward_records_nothing_and_computes_what_forward_detailed_computes(
    name: str, options: dict[str, object], batch: int
) -> None:
    model = vitrim.reduce.apply(tiny(), name, **options)
    x = images(batch=batch)
    with torch.no_grad():
        plain = model.embed(x, record=False)
        for block in model.blocks:
            plain, _ = block(plain)
        detailed = model.forward_detailed(x)
        logits = model(x)
    assert plain.positions is None and plain.kept_indices == () and plain.patch_to_token == ()
    assert plain.block_positions == () and plain.fused is None
    assert torch.equal(logits, detailed.logits)  # the same calls but the bookkeeping
    assert len(detailed.block_positions) == 4 and (detailed.kept_indices or detailed.patch_to_token)


def test_create_model_with_a_reducer() -> None:
    model = vitrim.create_model("vit_tiny_patch16_224", depth=2, img_size=32, patch_size=8, reducer="tome", r=3)
    assert [repr(b.reducer) for b in model.blocks] == ["ToMe(r=3)", "ToMe(r=3)"]
    model = vitrim.create_model("deit_tiny_patch16_224", depth=4, img_size=32, reducer="evit:keep_rate=0.5,layers=(1,)")
    assert [type(b.reducer).__name__ for b in model.blocks] == ["NoneType", "EViT", "NoneType", "NoneType"]
    with pytest.raises(ValueError, match=r"unknown reducer 'tomee'.*did you mean tome"):
        vitrim.create_model("vit_tiny_patch16_224", depth=2, reducer="tomee", r=3)
    with pytest.raises(ValueError, match=r"unknown config option\(s\) \['keep_rate'\]"):
        vitrim.create_model("vit_tiny_patch16_224", depth=2, reducer="tome", r=3, keep_rate=0.5)


def test_parse_spec() -> None:
    assert parse_spec("tome:r=13") == ("tome", {"r": 13})
    assert parse_spec("tome") == ("tome", {})
    assert parse_spec("evit:keep_rate=0.7, layers=(3,6,9)") == ("evit", {"keep_rate": 0.7, "layers": (3, 6, 9)})
    assert parse_spec("tome:r=[8,8,4]") == ("tome", {"r": [8, 8, 4]})
    with pytest.raises(ValueError, match="must look like name=value"):
        parse_spec("tome:13")
    with pytest.raises(ValueError, match="is not a number or tuple"):
        parse_spec("tome:r=__import__('os')")


def test_remove_leaves_other_reducers_alone() -> None:
    class Other(Reducer):
        def before_attention(self, state: TokenState) -> TokenState:
            return state

    model = vitrim.reduce.apply(tiny(), "tome", r=2)
    model.blocks[0].reducer = Other()
    vitrim.reduce.remove(model)
    assert isinstance(model.blocks[0].reducer, Other)
    assert [b.reducer for b in model.blocks[1:]] == [None] * 3


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("tome", {"r": -1}, r"r must be an int >= 0.*-1"),
        ("tome", {"r": 1.5}, r"r must be an int >= 0.*1\.5"),
        ("tome", {"r": [1, 2, 3, 4, 5]}, r"at most one value per block \(4\), got 5 values"),  # shorter: padded
        ("tome", {"r": 2, "keep_rate": 0.5}, r"unknown option\(s\) \['keep_rate'\] for reducer 'tome'"),
        ("evit", {"keep_rate": 0.0}, r"keep_rate must be a number in \(0, 1\].*0\.0"),
        ("topk", {"keep_rate": 1.01}, r"keep_rate must be a number in \(0, 1\].*1\.01"),
        ("evit", {"layers": (1, 4)}, r"layers must be block indices in \[0, 4\), got \(1, 4\)"),
        ("topk", {"layers": (-1,)}, r"layers must be block indices in \[0, 4\), got \(-1,\)"),
        ("evit", {"layers": (1, 1)}, "must not repeat"),
        ("evit", {"keep_rate": (0.5, 0.7), "layers": (1,)}, r"one per reducing block \(1: layers \(1,\)\), got 2"),
        ("topk", {"keep_rate": (0.5, 1.5), "layers": (1, 2)}, r"keep_rate must be a number in \(0, 1\].*1\.5"),
        ("merge", {}, r"unknown reducer 'merge'; expected one of \[.*'evit', .*'tome', .*'topk'.*\]"),
        ("tome", {}, r"reducer 'tome' needs option\(s\) \['r'\]"),
    ],
)
def test_bad_arguments_raise_clear_errors(name: str, options: dict[str, object], message: str) -> None:
    model = tiny()
    with pytest.raises(ValueError, match=message):
        vitrim.reduce.apply(model, name, **options)
    assert all(block.reducer is None for block in model.blocks)  # nothing half-applied


def test_apply_refuses_a_second_reducer_on_a_block_and_models_it_cannot_use() -> None:
    model = vitrim.reduce.apply(tiny(), "evit", layers=(1,))
    with pytest.raises(ValueError, match="block 1 already has a reducer EViT"):
        vitrim.reduce.apply(model, "topk", layers=(1, 2))
    assert model.blocks[2].reducer is None
    with pytest.raises(ValueError, match=r"no \[CLS\] token"):
        vitrim.reduce.apply(tiny(class_token=False, global_pool="avg"), "topk")
    with pytest.raises(TypeError, match=r"model must have \.blocks"):
        vitrim.reduce.apply(torch.nn.Linear(2, 2), "tome", r=1)


def test_default_layers_follow_evit() -> None:
    model = vitrim.reduce.apply(tiny(depth=12), "evit")
    assert [i for i, b in enumerate(model.blocks) if b.reducer is not None] == [3, 6, 9]
    assert {type(b.reducer) for b in model.blocks} == {EViT, type(None)}
    vitrim.reduce.remove(model)
    vitrim.reduce.apply(model, "topk", keep_rate=(0.9, 0.5), layers=(2, 5))
    assert [repr(b.reducer) for b in model.blocks if b.reducer] == ["TopK(keep_rate=0.9)", "TopK(keep_rate=0.5)"]
    assert ToMe and TopK  # the classes are public


NEW_REDUCER = """
import torch

from vitrim.reduce import Reducer, register


@register("halve")
class Halve(Reducer):
    example_options = {"layers": (1,)}
    identity_options = {"layers": ()}

    def after_attention(self, state, attention):
        first_half = torch.arange(state.num_patch_tokens // 2).expand(state.tokens.shape[0], -1)  # (B, n // 2)
        return self.keep(state, first_half)
"""

CHECK = """
import torch, vitrim
assert "halve" in vitrim.reduce.list_reducers(), vitrim.reduce.list_reducers()
torch.manual_seed(0)
model = vitrim.create_model(
    "vit_tiny_patch16_224", embed_dim=32, depth=4, num_heads=2, img_size=32, patch_size=8
).eval()
x = torch.randn(2, 3, 32, 32)
dense = model(x)
vitrim.reduce.apply(model, "halve", layers=(1,))
out = model.forward_detailed(x)
assert out.tokens.shape[1] == 1 + 8 and out.kept_indices[0].tolist() == [list(range(8))] * 2
vitrim.reduce.remove(model)
assert torch.equal(model(x), dense) and all(b.reducer is None for b in model.blocks)
print("ok")
"""


def test_a_new_reducer_is_one_file(tmp_path: Path) -> None:
    """The plug-in promise: a file dropped into vitrim/reduce registers, applies and removes, nothing else edited."""
    package = Path(vitrim.__file__).parent
    copy = tmp_path / "vitrim"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.npz"))
    (copy / "reduce" / "halve.py").write_text(NEW_REDUCER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
