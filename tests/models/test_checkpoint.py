"""save_checkpoint / load_checkpoint / load_model: round trips, safety, clear errors, head and grid adaptation."""

from __future__ import annotations

import argparse
import io
import itertools
import pickle
import pickletools
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import vitrim
from vitrim.weights.checkpoint import CheckpointMismatchError

TINY = dict(embed_dim=32, depth=2, num_heads=2, img_size=32, patch_size=8, num_classes=5)


def tiny(seed: int = 0, **changes: object) -> nn.Module:
    torch.manual_seed(seed)
    return vitrim.create_model("vit_tiny_patch16_224", **{**TINY, **changes}).eval()


def images(size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))


def assert_same_weights(a: nn.Module, b: nn.Module, skip: tuple[str, ...] = ()) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if not key.startswith(skip):
            torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0, msg=key)


# -- save / load round trip ------------------------------------------------------------------------------------


def test_save_then_load_model_gives_identical_logits_and_config(tmp_path: Path) -> None:
    model = tiny(distilled=True, global_pool="token", qkv_bias=False, init_values=0.1)
    path = vitrim.save_checkpoint(model, tmp_path / "sub" / "model.safetensors")  # parent folder is created
    assert path == tmp_path / "sub" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["vitrim.class"] == "vitrim.models.vit:VisionTransformer"
    assert meta["vitrim.config_class"] == "vitrim.models.config:ViTConfig"
    loaded = vitrim.load_model(path)
    assert type(loaded) is type(model) and loaded.config == model.config and not loaded.training
    assert_same_weights(model, loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images()), model(images()), rtol=0, atol=0)


def test_load_model_overrides_resample_and_replace_head(tmp_path: Path) -> None:
    model = tiny()
    path = vitrim.save_checkpoint(model, tmp_path / "m.safetensors")
    with pytest.warns(UserWarning, match=r"5 classes, the model's 3"):
        loaded = vitrim.load_model(path, img_size=64, num_classes=3)
    assert loaded.config.img_size == (64, 64) and loaded.config.num_classes == 3
    assert loaded.pos_embed.shape == (1, 1 + 64, 32)
    for key, value in model.state_dict().items():
        if not key.startswith(("head.", "pos_embed")):
            torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.safetensors"
    vitrim.save_checkpoint(tiny(seed=0), path)
    before = path.read_bytes()

    def broken_save(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr("vitrim.weights.checkpoint.save_file", broken_save)
    with pytest.raises(OSError, match=r"disk full"):
        vitrim.save_checkpoint(tiny(seed=1), path)
    assert path.read_bytes() == before  # the old checkpoint survives a failed save
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_saved_file_gets_the_usual_permissions(tmp_path: Path) -> None:
    reference = tmp_path / "plain.txt"
    reference.write_text("x")  # what any new file gets under this umask
    path = vitrim.save_checkpoint(tiny(), tmp_path / "m.safetensors")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)


def test_save_checkpoint_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got dict"):
        vitrim.save_checkpoint({"a": torch.zeros(1)}, tmp_path / "x.safetensors")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"path must be a str or os.PathLike, got int"):
        vitrim.save_checkpoint(tiny(), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"is a directory"):
        vitrim.save_checkpoint(tiny(), tmp_path)


# -- formats recognised by content -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bare", "model", "state_dict", "ddp", "legacy"])
def test_torch_save_layouts_load_whatever_the_file_name(tmp_path: Path, layout: str) -> None:
    source = tiny(seed=3)
    sd = source.state_dict()
    path = tmp_path / "weights.ckpt"  # an extension vitrim has never heard of: the content decides
    if layout == "bare":
        torch.save(sd, path)
    elif layout == "model":  # DeiT releases: weights next to the optimizer state and the training args
        args = argparse.Namespace(lr=5e-4, output_dir=Path("runs/deit"), model="deit_tiny")
        torch.save({"model": sd, "optimizer": {"lr": 1.0}, "epoch": 299, "args": args, "acc": np.float64(72.2)}, path)
    elif layout == "state_dict":
        torch.save({"state_dict": sd, "epoch": 3}, path)
    elif layout == "ddp":
        torch.save({"model": {f"module.{k}": v for k, v in sd.items()}}, path)
    else:
        torch.save({"model": sd}, path, _use_new_zipfile_serialization=False)
    target = tiny(seed=4)
    result = vitrim.load_checkpoint(target, path)
    assert result.format == "timm" and not (result.missing or result.unexpected or result.mismatched)
    assert_same_weights(source, target)


def _evil_class(marker: Path) -> type:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return exec, (f"open({str(marker)!r}, 'w').close()",)

    return Evil


def _pickle_globals(data: bytes) -> list[str]:
    """The callables a pickle would import (read with pickletools, which executes nothing)."""
    ops = [(op, arg) for op, arg, _ in pickletools.genops(io.BytesIO(data))]
    strings = [arg for _, arg in ops if isinstance(arg, str)]  # protocol 4: STACK_GLOBAL of two strings
    return [f"{a} {b}" for a, b in itertools.pairwise(strings)] + [str(arg) for op, arg in ops if op.name == "GLOBAL"]


@pytest.mark.parametrize("container", ["torch_zip", "torch_legacy", "plain_pickle"])
def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path, container: str) -> None:
    marker = tmp_path / "pwned"
    payload = {"model": tiny().state_dict(), "args": _evil_class(marker)()}
    path = tmp_path / "evil.pth"
    if container == "torch_zip":
        torch.save(payload, path)
        with zipfile.ZipFile(path) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    elif container == "torch_legacy":
        torch.save(payload, path, _use_new_zipfile_serialization=False)
        data = b""
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))
        data = path.read_bytes()
    if data:  # the file really would call exec: the refusal below is not vacuous
        assert any("exec" in g for g in _pickle_globals(data))
    with pytest.raises(ValueError, match=r"refusing to load .*could run code"):
        vitrim.load_checkpoint(tiny(), path)
    assert not marker.exists()


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match=r"nope.safetensors"):
        vitrim.load_checkpoint(tiny(), path)
    with pytest.raises(FileNotFoundError, match=r"nope.safetensors"):
        vitrim.load_model(path)
    with pytest.raises(FileNotFoundError, match=r"nope.safetensors"):
        vitrim.create_model("vit_tiny_patch16_224", checkpoint=path, **TINY)


@pytest.mark.parametrize(
    ("content", "found"),
    [
        (b"", "an empty file"),
        (b"hello, I am a README\n", "a text file starting 'hello, I am a README'"),
        (b"\x1f\x8b\x08\x00rest", "a gzip archive"),
        (bytes(range(200, 256)), "56 bytes of unknown binary data starting c8 c9 ca"),
    ],
    ids=["empty", "text", "gzip", "binary"],
)
def test_not_a_checkpoint_says_what_was_found(tmp_path: Path, content: bytes, found: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"not a checkpoint: found {found}"):
        vitrim.load_checkpoint(tiny(), path)


@pytest.mark.parametrize("layout", ["safetensors", "zip", "legacy-pickle"])
def test_a_truncated_file_is_a_value_error_naming_it(tmp_path: Path, layout: str) -> None:
    model = tiny()
    whole = tmp_path / f"whole.{layout}"
    if layout == "safetensors":
        vitrim.save_checkpoint(model, whole)
    else:
        torch.save(model.state_dict(), whole, _use_new_zipfile_serialization=layout == "zip")
    data = whole.read_bytes()
    cut = tmp_path / f"cut.{layout}"
    for fraction in (0.02, 0.1, 0.5, 0.9, 0.999):
        cut.write_bytes(data[: int(len(data) * fraction)])
        for load in (lambda: vitrim.load_checkpoint(model, cut), lambda: vitrim.load_model(cut)):
            with pytest.raises(
                ValueError, match=rf"'{cut}'.*(truncated or corrupt|could not be read|not a checkpoint)"
            ):
                load()


def test_a_pickle_without_tensors_says_what_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "stats.pth"
    torch.save({"epoch": 3, "acc": 71.0}, path)
    with pytest.raises(ValueError, match=r"holds no state dict: found a dict with keys \['acc', 'epoch'\]"):
        vitrim.load_checkpoint(tiny(), path)


def test_a_directory_without_weights_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"not a checkpoint: expected one of .*found \['notes.txt'\]"):
        vitrim.load_model(tmp_path)


def test_load_checkpoint_rejects_bad_arguments(tmp_path: Path) -> None:
    path = vitrim.save_checkpoint(tiny(), tmp_path / "m.safetensors")
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got str"):
        vitrim.load_checkpoint("model", path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"strict must be a bool, got 'yes'"):
        vitrim.load_checkpoint(tiny(), path, strict="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"path must be a str or os.PathLike, got NoneType"):
        vitrim.load_checkpoint(tiny(), None)  # type: ignore[arg-type]


def test_load_model_needs_a_config(tmp_path: Path) -> None:
    path = tmp_path / "timm.safetensors"
    save_file(tiny().state_dict(), str(path))
    with pytest.raises(ValueError, match=r"bare timm state dict.*vitrim.create_model"):
        vitrim.load_model(path)


def test_load_model_builds_only_vitrim_classes(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    meta = {"vitrim.class": "os:system", "vitrim.config": "{}"}
    save_file(tiny().state_dict(), str(path), metadata=meta)
    with pytest.raises(ValueError, match=r"refusing to build model class 'os:system'"):
        vitrim.load_model(path)


# -- strict checking, heads, grids, optional keys --------------------------------------------------------------


def test_wrong_architecture_raises_one_error_listing_keys(tmp_path: Path) -> None:
    path = vitrim.save_checkpoint(tiny(), tmp_path / "m.safetensors")
    deeper = tiny(depth=3, embed_dim=48, num_heads=2)
    with pytest.raises(CheckpointMismatchError) as info:
        vitrim.load_checkpoint(deeper, path)
    message = str(info.value)
    assert "does not fit VisionTransformer" in message
    assert "12 missing key(s): blocks.2." in message  # block 2: norm1/2, qkv, proj, fc1, fc2 weights and biases
    assert "shape mismatch(es): " in message and "checkpoint [32] vs model [48]" in message
    assert "(+" in message  # long lists are cut, with the count of the rest
    assert isinstance(info.value, ValueError)


def test_unexpected_keys_are_listed_and_strict_false_loads_the_rest(tmp_path: Path) -> None:
    source = tiny(seed=5)
    path = tmp_path / "m.safetensors"
    save_file({**source.state_dict(), "extra.weight": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointMismatchError, match=r"1 unexpected key\(s\): extra.weight"):
        vitrim.load_checkpoint(tiny(), path)
    target = tiny(seed=6)
    with pytest.warns(UserWarning, match=r"skipped: 1 unexpected"):
        result = vitrim.load_checkpoint(target, path, strict=False)
    assert result.unexpected == ["extra.weight"]
    assert_same_weights(source, target)


def test_other_num_classes_keeps_a_fresh_head_with_a_warning(tmp_path: Path) -> None:
    source = tiny(seed=7)
    path = vitrim.save_checkpoint(source, tmp_path / "m.safetensors")
    target = tiny(seed=8, num_classes=3)
    fresh_head = target.head.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"5 classes, the model's 3; the model's freshly initialised head is kept"):
        result = vitrim.load_checkpoint(target, path)
    assert result.fresh == ["head.weight", "head.bias"] and result.ignored == ["head.weight", "head.bias"]
    torch.testing.assert_close(target.head.weight, fresh_head, rtol=0, atol=0)
    for key, value in source.state_dict().items():
        if not key.startswith("head."):
            torch.testing.assert_close(target.state_dict()[key], value, rtol=0, atol=0)
    features = tiny(num_classes=0)
    with pytest.warns(UserWarning, match=r"model has no head"):
        vitrim.load_checkpoint(features, path)
    with torch.no_grad():
        torch.testing.assert_close(features(images()), source.forward_head(source.forward_features(images()), True))


def test_pos_embed_is_resampled_to_the_model_grid(tmp_path: Path) -> None:
    source = tiny(seed=9)  # learned at 32 px: a 4x4 grid
    path = vitrim.save_checkpoint(source, tmp_path / "m.safetensors")
    target = tiny(seed=10, img_size=64)  # 8x8
    result = vitrim.load_checkpoint(target, path)
    assert result.resampled_pos_embed == ((4, 4), (8, 8))
    # by hand: bicubic, antialiased, prefix kept (timm's resample_abs_pos_embed)
    grid = source.pos_embed[:, 1:].reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(8, 8), mode="bicubic", antialias=True, align_corners=False)
    expected = torch.cat([source.pos_embed[:, :1], expected.permute(0, 2, 3, 1).reshape(1, 64, 32)], dim=1)
    torch.testing.assert_close(target.pos_embed, expected, rtol=0, atol=1e-7)
    x = images(64)
    with torch.no_grad():  # the source model resamples on the fly at 64 px: the same numbers
        torch.testing.assert_close(target(x), source(x), rtol=0, atol=1e-6)


def test_non_square_grid_from_the_vitrim_config(tmp_path: Path) -> None:
    source = tiny(seed=11, img_size=(32, 64))  # 4x8 grid: the config in the file says so
    path = vitrim.save_checkpoint(source, tmp_path / "m.safetensors")
    target = tiny(seed=12, img_size=(64, 32))
    assert vitrim.load_checkpoint(target, path).resampled_pos_embed == ((4, 8), (8, 4))
    x = torch.randn(2, 3, 64, 32)
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "changes, before",  # before: position-embedding rows of the prefix ahead of the registers
    [({}, 1), ({"distilled": True}, 2), ({"img_size": 64}, 1), ({"no_embed_class": True}, 0)],
    ids=["cls", "cls+dist", "cls+new-grid", "no-embed-class"],
)
def test_registers_added_to_a_checkpoint_without_them_start_fresh(
    tmp_path: Path, changes: dict[str, object], before: int
) -> None:
    source = tiny(seed=14, **{k: v for k, v in changes.items() if k != "img_size"})
    path = vitrim.save_checkpoint(source, tmp_path / "m.safetensors")
    target = tiny(seed=15, reg_tokens=3, **changes)
    fresh_token, fresh_pos = target.reg_token.detach().clone(), target.pos_embed.detach().clone()
    with pytest.warns(UserWarning, match=r"no register tokens; the model's 3 register\(s\) \(reg_token"):
        result = vitrim.load_checkpoint(target, path)
    assert result.fresh == ["reg_token"] and not result.missing and not result.mismatched
    torch.testing.assert_close(target.reg_token, fresh_token, rtol=0, atol=0)
    # by hand: the checkpoint's prefix rows, then the registers' own rows, then the checkpoint's patch rows
    patch_rows = source.pos_embed[:, before:]
    if "img_size" in changes:
        grid = patch_rows.reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(8, 8), mode="bicubic", antialias=True, align_corners=False)
        patch_rows = grid.permute(0, 2, 3, 1).reshape(1, 64, 32)
        assert result.resampled_pos_embed == ((4, 4), (8, 8))
    registers = fresh_pos[:, :0] if changes.get("no_embed_class") else fresh_pos[:, before : before + 3]
    expected = torch.cat([source.pos_embed[:, :before], registers, patch_rows], dim=1)
    torch.testing.assert_close(target.pos_embed, expected, rtol=0, atol=1e-7)
    for key, value in source.state_dict().items():
        if key != "pos_embed":
            torch.testing.assert_close(target.state_dict()[key], value, rtol=0, atol=0)
    # the other way round is not a known adaptation: the registers are reported, and strict loading refuses
    with pytest.raises(CheckpointMismatchError, match=r"unexpected key\(s\): reg_token"):
        vitrim.load_checkpoint(tiny(**changes), vitrim.save_checkpoint(target, tmp_path / "reg.safetensors"))


class WithExtras(nn.Module):
    """A model that declares parameters a checkpoint may lack (as DynamicViT does for its predictors)."""

    checkpoint_optional_prefixes = ("extra.",)

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(3, 4)
        self.extra = nn.Linear(4, 1)


def test_optional_prefixes_may_be_missing_but_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "dense.safetensors"
    source = nn.Linear(3, 4)
    save_file({"backbone.weight": source.weight.detach(), "backbone.bias": source.bias.detach()}, str(path))
    model = WithExtras()
    extra_before = model.extra.weight.detach().clone()
    result = vitrim.load_checkpoint(model, path)
    assert result.fresh == ["extra.weight", "extra.bias"] and not result.missing
    torch.testing.assert_close(model.backbone.weight, source.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.extra.weight, extra_before, rtol=0, atol=0)
    save_file({"backbone.weight": source.weight.detach()}, str(path))
    with pytest.raises(CheckpointMismatchError, match=r"1 missing key\(s\): backbone.bias"):
        vitrim.load_checkpoint(WithExtras(), path)


@pytest.mark.skipif(not vitrim.list_models("dynamicvit_*"), reason="DynamicViT is not registered")
def test_dense_checkpoint_into_dynamicvit_and_official_layout_back(tmp_path: Path) -> None:
    dense = tiny(seed=13, depth=4)
    path = tmp_path / "deit.pth"
    torch.save({"model": dense.state_dict()}, path)
    dyn = vitrim.create_model("dynamicvit_tiny_patch16_224", checkpoint=path, **{**TINY, "depth": 4})
    for key, value in dense.state_dict().items():
        torch.testing.assert_close(dyn.state_dict()[key], value, rtol=0, atol=0)
    official = tmp_path / "dynamicvit.pth"  # official releases: {"model": timm names + score_predictor.*}
    torch.save({"model": dyn.state_dict()}, official)
    again = vitrim.create_model("dynamicvit_tiny_patch16_224", **{**TINY, "depth": 4})
    assert vitrim.load_checkpoint(again, official).format == "dynamicvit"
    assert_same_weights(dyn, again)
    with pytest.raises(CheckpointMismatchError, match=r"unexpected key\(s\): score_predictor"):
        vitrim.load_checkpoint(tiny(depth=4), official)
