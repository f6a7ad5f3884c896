"""Faults: a training run killed at random moments resumes to the same weights (and the next run clears the torn
temporary files a kill leaves); a torn resume file or a NaN loss stops with a clear error and leaves the last good
checkpoints as they were."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitrim.cli import main
from vitrim.train import TrainConfig, train
from vitrim.train import loop as loop_module
from vitrim.train.loop import TrainingDiverged

TINY = "img_size=16,patch_size=4,in_chans=1,embed_dim=16,depth=1,num_heads=2"
ARGS = ["train", "--model", "vit_tiny_patch16_224", "--set", TINY, "--epochs", "4", "--batch-size", "128"]
ARGS += ["--quiet", "--threads", "1"]


def run_cli(out: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "vitrim.cli", *ARGS, "--out", str(out), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_sigkill_at_random_moments_then_resume_ends_bit_identical(tmp_path: Path) -> None:
    reference = tmp_path / "uninterrupted"
    assert run_cli(reference).wait(timeout=300) == 0
    out, rng, kills = tmp_path / "killed", random.Random(0), 0
    for _ in range(12):  # bounded: each try either finishes or is killed once
        resume = ["--resume"] if (out / "last.pt").exists() else []
        proc = run_cli(out, *resume)
        if kills < 3:
            time.sleep(rng.uniform(2.0, 5.0))  # import takes ~2 s; epochs, metrics and checkpoint writes follow
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        code = proc.wait(timeout=300)
        if code == 0:
            break
        assert code == -signal.SIGKILL, proc.stderr.read().decode() if proc.stderr else code
    else:
        pytest.fail("the killed run never finished")
    assert kills >= 1
    final, expected = load_file(str(out / "last.safetensors")), load_file(str(reference / "last.safetensors"))
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final)  # bit for bit
    assert not list(out.glob(".*.tmp"))  # no torn temporary files left behind


def test_a_truncated_resume_file_is_a_clear_error_and_nothing_is_overwritten(tmp_path: Path, capsys) -> None:
    assert run_cli(tmp_path, "--epochs", "1").wait(timeout=300) == 0
    state = tmp_path / "last.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    code = main([*ARGS, "--out", str(tmp_path), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "last.pt' is truncated or corrupt" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_nan_loss_stops_training_naming_the_step_and_keeps_the_last_good_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = loop_module.CrossEntropyObjective.__call__

    def nan_in_epoch_2(self, model, images, labels, epoch):  # type: ignore[no-untyped-def]
        loss = real(self, model, images, labels, epoch)
        return loss * float("nan") if epoch == 1 else loss

    monkeypatch.setattr(loop_module.CrossEntropyObjective, "__call__", nan_in_epoch_2)
    overrides = dict(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)
    config = TrainConfig("vit_tiny_patch16_224", out=str(tmp_path), epochs=3, overrides=overrides, quiet=True)
    with pytest.raises(TrainingDiverged, match=r"the loss is nan at epoch 2, step 1; the checkpoints of the last"):
        train(config)
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert state["epoch"] == 1 and all(torch.isfinite(v).all() for v in state["model"].values())
    weights = load_file(str(tmp_path / "last.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_a_run_starts_by_removing_the_torn_temporary_files_of_a_killed_writer(tmp_path: Path) -> None:
    # what a SIGKILL during atomic_write leaves: the temporary file, half written; nothing ran to remove it
    torn = [tmp_path / ".last.pt.k1ll3d00.tmp", tmp_path / ".best.safetensors.ab12cd34.tmp"]
    kept = [tmp_path / ".notes.txt.ab12cd34.tmp", tmp_path / "last.pt.tmp"]  # not atomic_write's, for these names
    for path in torn + kept:
        path.write_bytes(b"half a checkpoint")
    overrides = dict(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)
    train(TrainConfig("vit_tiny_patch16_224", out=str(tmp_path), epochs=1, overrides=overrides, quiet=True))
    assert not any(path.exists() for path in torn) and all(path.exists() for path in kept)
    assert (tmp_path / "last.pt").stat().st_size > 1000  # the run itself went on to write its checkpoints
