"""``vitrim demo translate --quick`` end to end (a tiny run, well under 30 s), then ``vitrim translate`` on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vitrim.cli import main
from vitrim.demos.translate.inference import load_run, translate_text


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("translate")
    before = torch.get_num_threads()
    try:
        assert main(["demo", "translate", "--quick", "--quiet", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    return out


def test_quick_demo_writes_summary_report_pictures_and_model(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("exact_match", "chrf", "alignment_accuracy", "seconds"):
        assert isinstance(summary[key], float), key
    assert 0.0 <= summary["exact_match"] <= 1.0 and 0.0 <= summary["alignment_accuracy"] <= 1.0
    assert 0.0 <= summary["chrf"] <= 100.0 and summary["seconds"] > 0
    assert summary["data"]["train_numbers"] + summary["data"]["test_numbers"] == 120
    assert summary["sentences"] == 2 * summary["data"]["test_numbers"]  # both languages of every held-out number
    assert set(summary["alignment_by_language"]) == {"de", "fr"}
    report = (run_dir / "report.md").read_text()
    assert "| all |" in report and "alignment accuracy" in report
    assert summary["pictures"] and any(name.startswith("cross_attention_de_") for name in summary["pictures"])
    for name in summary["pictures"]:
        assert (run_dir / name).stat().st_size > 5_000 and f"({name})" in report
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "vocab.json").is_file()


def test_translate_command_prints_and_draws(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "a.png"
    assert main(["translate", "twenty-one", "--run", str(run_dir), "--to", "fr", "--show-attention", str(png)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("twenty - one  ->  ")
    assert "[A] cross-attention, decoder layer 0, mean of 2 heads" in text
    assert png.stat().st_size > 5_000


def test_translation_attention_is_the_models_own(run_dir: Path) -> None:
    """The map `vitrim translate` shows is the model's teacher-forced cross-attention on its own output."""
    run = load_run(run_dir)
    result = translate_text(run, "21", "de")  # digits are written out first
    assert result.source == ["twenty", "-", "one"]
    maps = result.cross_attention  # (layers, H, Lt + 1, Ls)
    assert maps.shape[2:] == (len(result.target) + 1, 3)
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1]))
    beam = translate_text(run, "twenty-one", "de", beam_size=1)
    assert beam.target == result.target


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["translate", "twenty-onee"], "word 'onee' in 'twenty-onee' is out of vocabulary"),
        (["translate", "twenty-one", "--to", "es"], "--to must be one of ['de', 'fr']"),
        (["translate", "twenty-one", "--layer", "7"], "--layer must be in [0, 1)"),
        (["translate", "   "], "text must be English number words"),
    ],
)
def test_bad_input_is_named(run_dir: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--run", str(run_dir)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("beam", ["0", "65"])
def test_a_beam_out_of_range_is_refused_before_the_run_is_read(beam: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["translate", "twenty-one", "--beam", beam, "--run", "no/such/run"])
    assert exit_.value.code == 2
    assert f"argument --beam: expected an int in [1, 64] (hypotheses kept per step), got '{beam}'" in (
        capsys.readouterr().err
    )


def test_missing_run_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["translate", "one", "--run", str(tmp_path / "nope")]) == 2
    assert "nope' is not a folder; train one with `vitrim demo translate`" in capsys.readouterr().err


def test_demo_modes_parse(capsys: pytest.CaptureFixture[str]) -> None:
    from vitrim.cli import build_parser

    parser = build_parser()
    plain = parser.parse_args(["demo", "--quick"])
    assert plain.quick and getattr(plain, "demo_mode", None) is None
    assert plain.func.__module__ == "vitrim.cli.demo"  # plain `vitrim demo` is still the ViT demo
    mode = parser.parse_args(["demo", "translate", "--out", "x"])
    assert mode.demo_mode == "translate" and mode.out == "x" and mode.func.__module__ == "vitrim.cli.translate"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "transl"])
    assert "invalid choice: 'transl'" in capsys.readouterr().err
