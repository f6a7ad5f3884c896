"""The training loop on tiny models: it learns, resumes exactly, survives a crash mid-checkpoint, refuses misuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from vitrim.train import TrainConfig, train
from vitrim.train import loop as loop_module
from vitrim.train import state as state_module
from vitrim.train.state import load_training_state, save_training_state

TINY_VIT = dict(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2, drop_path_rate=0.1)
TINY_CNN = dict(img_size=16, in_chans=1, widths=(8, 16))


def _config(out: Path, **changes: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        model="vit_tiny_patch16_224", out=str(out), epochs=2, overrides=TINY_VIT, batch_size=128, quiet=True
    )
    return TrainConfig(**{**base, **changes})


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_training_lowers_the_loss(tmp_path: Path) -> None:
    config = _config(tmp_path, model="cnn_small", overrides=TINY_CNN, epochs=3, lr=5e-3, batch_size=32, warmup_epochs=0)
    result = train(config)
    rows = _metrics(tmp_path)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 0.2
    assert result["test_top1"] > 0.3  # chance is 0.1
    assert result["test_top1"] == rows[-1]["test_top1"]
    for name in ("best.safetensors", "last.safetensors", "last.pt", "run.json"):
        assert (tmp_path / name).is_file()


def test_resume_ends_exactly_where_an_uninterrupted_run_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(_config(straight))

    real_report = loop_module._report

    def crash_after_first_epoch(metrics: dict[str, Any], *args: Any) -> None:
        real_report(metrics, *args)
        if metrics["epoch"] == 1:
            raise KeyboardInterrupt  # the run dies between epochs, after its checkpoint

    monkeypatch.setattr(loop_module, "_report", crash_after_first_epoch)
    with pytest.raises(KeyboardInterrupt):
        train(_config(resumed))
    monkeypatch.setattr(loop_module, "_report", real_report)
    assert load_training_state(resumed / "last.pt")["epoch"] == 1
    train(_config(resumed, resume=True))

    a, b = load_file(straight / "last.safetensors"), load_file(resumed / "last.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    rows_a = [{k: v for k, v in r.items() if not k.endswith("images_per_s")} for r in _metrics(straight)]  # timing
    rows_b = [{k: v for k, v in r.items() if not k.endswith("images_per_s")} for r in _metrics(resumed)]
    assert rows_a == rows_b and len(rows_a) == 2


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.pt"
    save_training_state(path, {"model": {"w": torch.ones(3)}, "epoch": 1})
    real_save = torch.save

    def save_half_then_die(obj: Any, f: Any) -> None:
        real_save(obj, f)
        with open(f, "r+b") as handle:
            handle.truncate(10)  # a torn write
        raise OSError("disk full")

    monkeypatch.setattr(state_module.torch, "save", save_half_then_die)
    with pytest.raises(OSError, match="disk full"):
        save_training_state(path, {"model": {"w": torch.zeros(3)}, "epoch": 2})
    monkeypatch.setattr(state_module.torch, "save", real_save)
    state = load_training_state(path)
    assert state["epoch"] == 1 and torch.equal(state["model"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temporary file left behind


def test_resume_state_loads_without_executing_code(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "epoch": 1, "payload": Path("x")}, path)  # an arbitrary class: not allowed
    with pytest.raises(Exception, match=r"(?i)weights_only|unsupported global"):
        load_training_state(path)


def test_misuse_is_refused_before_training(tmp_path: Path) -> None:
    train(_config(tmp_path, epochs=1))
    with pytest.raises(ValueError, match="--resume"):
        train(_config(tmp_path, epochs=1))
    with pytest.raises(ValueError, match=r"cannot resume.*lr"):
        train(_config(tmp_path, epochs=1, lr=0.5, resume=True))
    with pytest.raises(ValueError, match="num_classes"):
        _config(tmp_path, overrides={**TINY_VIT, "num_classes": 3}).validate()
    with pytest.raises(ValueError, match="keep_ratio"):
        _config(tmp_path, overrides={"keep_ratio": 1.5}).validate()
    with pytest.raises(ValueError, match="batch size must be a positive int, got 0"):
        _config(tmp_path, batch_size=0).validate()
    with pytest.raises(ValueError, match="unknown model 'vit_nope'"):
        _config(tmp_path, model="vit_nope").validate()
    with pytest.raises(FileNotFoundError, match="missing-folder"):
        _config(tmp_path, data=str(tmp_path / "missing-folder")).validate()


def test_bf16_autocast_trains_and_evaluates(tmp_path: Path) -> None:
    result = train(_config(tmp_path, epochs=1, bf16=True))
    row = _metrics(tmp_path)[0]
    assert torch.isfinite(torch.tensor(row["train_loss"])) and 0.0 <= result["test_top1"] <= 1.0
    weights = load_file(tmp_path / "last.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())  # autocast computes in bf16, stores fp32
