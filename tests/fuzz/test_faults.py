"""Faults: a training run killed at chosen moments (after an epoch's metrics line, after its checkpoint, and while
its checkpoint is half written) resumes to the same weights and metrics, and clears the torn temporary files a kill
leaves; a torn resume file or a NaN loss stops with a clear error and leaves the last good checkpoints as they were.

The kills are placed by what the run has done, never by the clock: ``paused_training.py`` runs ``vitrim train`` and
stops dead at the chosen event, and the test kills it there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitrim.cli import main
from vitrim.train import TrainConfig, train
from vitrim.train import loop as loop_module
from vitrim.train.loop import TrainingDiverged

TINY = "img_size=16,patch_size=4,in_chans=1,embed_dim=16,depth=1,num_heads=2"
ARGS = ["train", "--model", "vit_tiny_patch16_224", "--set", TINY, "--epochs", "3", "--batch-size", "128"]
ARGS += ["--quiet", "--threads", "1"]
PAUSED_TRAINING = Path(__file__).with_name("paused_training.py")
# (event, occurrence within that process): a fresh run killed after epoch 1's metrics line (before its last.pt), a
# fresh start killed once epoch 1 is committed, a resume killed with epoch 2's last.pt half written
KILLS = [("metrics", 1), ("checkpoint", 1), ("mid-write", 1)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def kill_at(out: Path, event: str, nth: int, *extra: str) -> None:
    """Run training until it pauses at its ``nth`` ``event``, then SIGKILL it there."""
    cmd = [sys.executable, str(PAUSED_TRAINING), event, str(nth), "--", *ARGS, "--out", str(out), *extra]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()  # blocks until the run pauses, or ends without pausing (EOF)
    if line.strip() != f"paused at {event} {nth}":
        proc.kill()
        pytest.fail(f"the run did not pause at {event} {nth}: stdout {line!r}, stderr {proc.stderr.read()[-2000:]}")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


def metric_lines(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.endswith("_per_s")} for line in lines]  # but the clock's


@pytest.mark.full  # trains in subprocesses killed at each moment: 15-36 s; the torn-file cases below run by default
def test_sigkill_at_chosen_moments_then_resume_ends_bit_identical(tmp_path: Path) -> None:
    reference, out = tmp_path / "uninterrupted", tmp_path / "killed"
    assert main([*ARGS, "--out", str(reference)]) == 0  # in this process: only the killed runs need their own
    for event, nth in KILLS:
        kill_at(out, event, nth, *(["--resume"] if (out / "last.pt").exists() else []))
    assert list(out.glob(".last.pt.*.tmp")), "the mid-write kill should have left a torn temporary file"
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0
    final, expected = load_file(str(out / "last.safetensors")), load_file(str(reference / "last.safetensors"))
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final)  # bit for bit
    assert metric_lines(out) == metric_lines(reference)  # every epoch once, in order, with the same numbers
    assert not list(out.glob(".*.tmp"))  # no torn temporary files left behind


def test_a_truncated_resume_file_is_a_clear_error_and_nothing_is_overwritten(tmp_path: Path, capsys) -> None:
    assert main([*ARGS, "--out", str(tmp_path), "--epochs", "1"]) == 0
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


def test_a_metrics_line_torn_by_a_kill_is_dropped_and_its_epoch_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Stop(Exception):
        pass

    def stop_after_epoch_1(metrics, writer, quiet):  # type: ignore[no-untyped-def]
        raise Stop  # epoch 1 is committed (metrics line, last.pt); the run dies before epoch 2

    overrides = dict(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)
    config = TrainConfig("vit_tiny_patch16_224", out=str(tmp_path), epochs=2, overrides=overrides, quiet=True)
    with monkeypatch.context() as patch:
        patch.setattr(loop_module, "_report", stop_after_epoch_1)
        with pytest.raises(Stop):
            train(config)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 2, "train_lo')  # what a kill during epoch 2's append leaves, before its last.pt
    train(dataclasses.replace(config, resume=True))
    assert [line["epoch"] for line in metric_lines(tmp_path)] == [1, 2]
