"""DynamicViT's recipe on an ImageNet-layout folder: a dense run, then fine-tuning with it as teacher (DeiT's
augmentations, worker processes, gradient accumulation); the loss falls, a resumed run ends bit-identical, and
accumulating micro-batches computes the whole batch's step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from vitrim.train import TrainConfig, train
from vitrim.train import loop as loop_module

TINY_VIT = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
NO_AUGMENT = dict(scale=(1.0, 1.0), hflip=0.0, randaugment=0, reprob=0.0, mixup=0.0, cutmix=0.0)


def _stripes(label: int, rng: np.random.Generator) -> Image.Image:
    """Class k: stripes of period k + 2 at a random phase and colour, plus noise (learnable, not trivial)."""
    period = label + 2
    phase = rng.integers(period)
    rows = ((np.arange(16)[:, None] + phase) % period < period / 2) * np.ones((1, 16))
    tint = rng.uniform(0.4, 1.0, 3)
    pixels = rows[..., None] * tint * 255 + rng.normal(0, 20, (16, 16, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def imagenet_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.default_rng(0)
    for split, count in (("train", 32), ("val", 8)):
        for label in range(3):
            folder = root / split / f"n0{label}"
            folder.mkdir(parents=True)
            for i in range(count):
                _stripes(label, rng).save(folder / f"{split}_{i}.JPEG", quality=95)
    return root


@pytest.fixture(scope="module")
def dense_teacher(imagenet_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dense")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before conftest's per-test one
    config = TrainConfig(
        model="deit_tiny_patch16_224", data=str(imagenet_folder), out=str(out), epochs=4, overrides=TINY_VIT,
        batch_size=16, lr=3e-3, warmup_epochs=0, quiet=True, workers=0, **NO_AUGMENT,
    )  # fmt: skip
    train(config)
    torch.set_num_threads(before)
    return out / "last.safetensors"


def _student(folder: Path, teacher: Path, out: Path, **changes: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        model="deit_tiny_patch16_224", data=str(folder), out=str(out), epochs=3, teacher=str(teacher),
        overrides={**TINY_VIT, "reducer": "dynamicvit", "keep_ratio": 0.5, "prune_layers": (1,)},
        batch_size=16, accum_steps=2, lr=2e-3, warmup_epochs=0, freeze_backbone_epochs=0, backbone_lr_scale=0.1,
        quiet=True, workers=2,
    )  # fmt: skip
    return TrainConfig(**{**base, **changes})


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dynamicvit_recipe_on_a_folder_learns_and_resumes_bit_identical(
    imagenet_folder: Path, dense_teacher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(_student(imagenet_folder, dense_teacher, straight))  # the DeiT recipe's augmentations, mixup included
    rows = _metrics(straight)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["test_num_samples"] == 24 and rows[-1]["test_num_skipped"] == 0

    real_report = loop_module._report

    def crash_after_first_epoch(metrics: dict[str, Any], *args: Any) -> None:
        real_report(metrics, *args)
        if metrics["epoch"] == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop_module, "_report", crash_after_first_epoch)
    with pytest.raises(KeyboardInterrupt):
        train(_student(imagenet_folder, dense_teacher, resumed))
    monkeypatch.setattr(loop_module, "_report", real_report)
    train(_student(imagenet_folder, dense_teacher, resumed, resume=True))
    a, b = load_file(straight / "last.safetensors"), load_file(resumed / "last.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("score_predictor.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    timing = [{k: v for k, v in r.items() if not k.endswith("images_per_s")} for r in rows]
    assert timing == [{k: v for k, v in r.items() if not k.endswith("images_per_s")} for r in _metrics(resumed)]


def test_accumulated_micro_batches_take_the_whole_batchs_step(
    imagenet_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = loop_module._step
    gradients: dict[int, list[dict[str, torch.Tensor]]] = {}

    def recording_step(run: Any, *args: Any) -> None:
        gradients[run.batches.micro_batch].append({n: p.grad.clone() for n, p in run.model.named_parameters()})
        real_step(run, *args)

    monkeypatch.setattr(loop_module, "_step", recording_step)
    for accum in (1, 4):
        gradients[32 // accum] = []
        config = TrainConfig(
            model="vit_tiny_patch16_224", data=str(imagenet_folder), out=str(tmp_path / f"accum{accum}"), epochs=1,
            overrides=TINY_VIT, batch_size=32, accum_steps=accum, lr=3e-3, warmup_epochs=0, quiet=True, workers=0,
            **NO_AUGMENT,
        )  # fmt: skip
        train(config)
    whole, accumulated = gradients[32], gradients[8]
    assert len(whole) == len(accumulated) == 3  # 96 images: 3 steps of 32 (of 4 micro-batches of 8)
    for step, (a, b) in enumerate(zip(whole, accumulated)):
        for name in a:  # the mean gradient of the same 32 images (summed in another order: last bits differ)
            torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-6, msg=f"step {step}: {name}")


def test_a_bare_timm_state_dict_is_the_teacher_of_its_own_architecture(
    imagenet_folder: Path, dense_teacher: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    bare = tmp_path / "timm_format.safetensors"  # timm's file: weights only, no config to rebuild the model from
    save_file(load_file(dense_teacher), bare)
    out = tmp_path / "student"
    train(_student(imagenet_folder, bare, out, epochs=1, workers=0, **NO_AUGMENT))
    student, dense = load_file(out / "last.safetensors"), load_file(dense_teacher)
    assert set(student) - set(dense) == {k for k in student if k.startswith("score_predictor.")}


def test_cli_trains_on_shards_and_evaluates_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("webdataset")
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "datasets"))
    from generated import write_shards

    from vitrim.cli import main

    train_shards = write_shards(tmp_path / "train", "train", [10, 10, 12], num_classes=2)
    val_shards = write_shards(tmp_path / "val", "val", [7, 6], num_classes=2, first_id=100)
    out = tmp_path / "run"
    tiny = ["--set", "img_size=8,patch_size=4,embed_dim=16,depth=1,num_heads=2"]
    argv = ["train", "--model", "vit_tiny_patch16_224", "--data", train_shards, "--val-data", val_shards, *tiny]
    assert main([*argv, "--epochs", "1", "--batch-size", "8", "--workers", "2", "--out", str(out), "--quiet"]) == 0
    assert _metrics(out)[0]["test_num_samples"] == 13
    assert main(["eval", str(out / "last.safetensors"), "--data", train_shards, "--workers", "0"]) == 0
    printed = capsys.readouterr().out
    assert f"on {train_shards} (test, 32 images)" in printed and "images/s end to end" in printed


def test_eval_reads_a_val_folder_whole_and_a_tree_by_its_val(imagenet_folder: Path, dense_teacher: Path) -> None:
    from vitrim.train import evaluate_checkpoint

    whole = evaluate_checkpoint(dense_teacher, data=str(imagenet_folder / "val"), workers=0)  # class folders alone
    tree = evaluate_checkpoint(dense_teacher, data=str(imagenet_folder), workers=0)  # train/ and val/: val/
    assert whole["num_samples"] == tree["num_samples"] == 24
    assert whole["top1"] == tree["top1"] and whole["loss"] == pytest.approx(tree["loss"], rel=1e-6)
    assert tree["top1"] > 1 / 3  # the dense run learned the stripes (chance: 1/3)


def test_eval_of_a_saved_run_sees_the_pixels_it_trained_on(imagenet_folder: Path, dense_teacher: Path) -> None:
    from vitrim.train import evaluate_checkpoint

    last = _metrics(dense_teacher.parent)[-1]
    for checkpoint in ("last.safetensors", "last.pt"):  # rebuilt from the file's metadata / from the run record
        metrics = evaluate_checkpoint(dense_teacher.parent / checkpoint, workers=0)
        assert metrics["num_samples"] == last["test_num_samples"] == 24
        assert metrics["loss"] == pytest.approx(last["test_loss"], rel=1e-6), checkpoint  # same mean, std, crop
        assert metrics["top1"] == last["test_top1"]
