"""The train / eval / demo commands: help for every subcommand, one-line errors with exit code 2, eval round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vitrim.cli import COMMANDS, main
from vitrim.train import TrainConfig, train

TINY = ["--set", "img_size=16", "--set", "patch_size=4", "--set", "in_chans=1", "--set", "embed_dim=16"]
TINY += ["--set", "depth=1", "--set", "num_heads=2"]
DVIT = "dynamicvit_tiny_patch16_224"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"vitrim {command}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--model", "vit_nope"], "unknown model 'vit_nope'"),
        (["train", "--model", "cnn_small", "--data", "{tmp}/no-such-folder"], "does not exist"),
        (["train", "--model", DVIT, "--set", "keep_ratio=1.5"], "keep_ratio must be in (0, 1]"),
        (["train", "--model", DVIT, "--set", "keep_ratio=0"], "keep_ratio must be in (0, 1]"),
        (["train", "--model", "cnn_small", "--set", "depth"], "--set expects key=value"),
        (["train", "--model", "cnn_small", "--set", ""], "got an empty value ''"),
        (["train", "--model", "cnn_small", "--teacher", "{tmp}/t.safetensors"], "needs a dynamicvit_* model"),
        (
            ["train", "--model", DVIT, "--distill", "ratio_weight=3"],
            "--distill ratio_weight=3 sets DynamicViT's distillation from a teacher, and no --teacher was given",
        ),
        (["eval", "{tmp}/missing.safetensors"], "does not exist"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_code_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] == "train":
        argv += ["--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitrim: error: ") and message in err[0], err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--batch-size", "0", "an int in [1, 65536] (images in one batch)"),
        ("--epochs", "0", "an int in [1, 100000] (epochs)"),
        ("--lr", "0", "a number in (0, 10] (a learning rate)"),
        ("--label-smoothing", "1", "a number in [0, 1) (the target's mass spread over every class)"),
    ],
)
def test_numbers_out_of_range_are_argparse_errors_before_any_work(
    option: str, value: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", "cnn_small", option, value, "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith(f"argument {option}: expected {expected}, got '{value}'")
    )
    assert not (tmp_path / "run").exists()


def test_train_then_eval_reports_the_same_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", "--model", "vit_tiny_patch16_224", "--epochs", "1", "--out", str(out), "--quiet", *TINY]) == 0
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    for checkpoint in ("last.safetensors", "last.pt"):
        report = tmp_path / f"{checkpoint}.json"
        assert main(["eval", str(out / checkpoint), "--json", str(report)]) == 0
        metrics = json.loads(report.read_text())
        for key in ("top1", "top5", "loss"):
            assert metrics[key] == pytest.approx(last[f"test_{key}"], rel=1e-6), (checkpoint, key)
        assert metrics["per_class"] == pytest.approx(last["test_per_class"])
        assert metrics["num_samples"] == 359 and metrics["images_per_s"] > 0
    assert "top-1" in capsys.readouterr().out


def test_eval_refuses_data_with_other_classes(tmp_path: Path) -> None:
    config = TrainConfig(
        model="cnn_small", out=str(tmp_path / "run"), epochs=1, batch_size=256, quiet=True,
        overrides={"img_size": 16, "in_chans": 1, "widths": (8, 16)},
    )  # fmt: skip
    train(config)
    from PIL import Image

    from vitrim.train import evaluate_checkpoint

    for name in ("a", "b", "c"):
        for i in range(5):
            (tmp_path / "imgs" / name).mkdir(parents=True, exist_ok=True)
            Image.new("L", (16, 16), 40 * i).save(tmp_path / "imgs" / name / f"{i}.png")
    with pytest.raises(ValueError, match=r"predicts 10 classes but data .* has 3"):
        evaluate_checkpoint(tmp_path / "run" / "last.safetensors", data=str(tmp_path / "imgs"))


def test_library_errors_name_arguments_and_the_cli_shows_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vitrim.data import check_data

    missing = str(tmp_path / "no-such-folder")
    with pytest.raises(FileNotFoundError, match=r"^data '.*no-such-folder' does not exist"):
        check_data(missing)  # the library's own word: the argument
    assert main(["train", "--model", "cnn_small", "--data", missing, "--out", str(tmp_path / "run")]) == 2
    assert f"vitrim: error: --data {missing!r} does not exist" in capsys.readouterr().err  # the command's: the flag
    argv = ["train", "--model", "vit_tiny_patch16_224", "--set", "reducer=mctf,r=8", "--mctf", "weight=1"]
    assert main([*argv, "--out", str(tmp_path / "mctf")]) == 2
    assert "vitrim: error: --mctf takes ['confidence'" in capsys.readouterr().err
