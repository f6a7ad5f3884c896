"""``vitrim vlm ask``, ``vitrim viz vlm``, ``vitrim demo vlm``: answers as the library gives them, one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from vitrim.cli import main  # noqa: E402
from vitrim.vlm_demo.ask import ask, read_canvas  # noqa: E402
from vitrim.vlm_demo.demo import QUICK  # noqa: E402
from vitrim.vlm_demo.evaluate import held_out  # noqa: E402
from vitrim.vlm_demo.model import build_model, digits_vlm_config, save_model  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vlm_run")
    save_model(build_model(digits_vlm_config(QUICK.vision, QUICK.text), seed=2), folder)
    return folder


def _png(tmp_path: Path, ink: np.ndarray, *, paper: bool) -> Path:
    grey = (1.0 - ink) if paper else ink  # dark ink on white paper, or the canvas as the model sees it
    path = tmp_path / "canvas.png"
    PIL.fromarray((grey * 255).round().astype(np.uint8)).save(path)
    return path


@pytest.mark.parametrize("paper", [False, True])
def test_ask_answers_as_the_library(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, paper: bool) -> None:
    canvas = held_out(1).pixels[0]
    path = _png(tmp_path, canvas, paper=paper)
    assert np.abs(read_canvas(path) - canvas).max() <= 1 / 255 + 1e-6  # paper pictures are inverted back
    from vitrim.vlm_demo.run_folder import load_digits_vlm

    expected = ask(load_digits_vlm(run), canvas, "how many digits ?").text
    assert main(["vlm", "ask", "--image", str(path), "--run", str(run), "how many digits"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == expected


def test_ask_with_a_method_reports_the_tokens_it_kept(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _png(tmp_path, held_out(1).pixels[0], paper=False)
    args = ["vlm", "ask", "--image", str(path), "--run", str(run), "which digit ?", "--method", "random", "--keep", "8"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("random: 8 of 64 image tokens entered the LLM")


def test_ask_errors_are_one_line(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _png(tmp_path, held_out(1).pixels[0], paper=False)
    base = ["vlm", "ask", "--image", str(path), "--run", str(run)]
    assert main([*base, "which colour ?"]) == 2
    assert "vitrim: error: the digits VLM does not know the word 'colour'" in capsys.readouterr().err
    assert main([*base, "which digit ?", "--method", "random", "--keep", "lots"]) == 2
    assert "--keep must be a token count" in capsys.readouterr().err
    assert main([*base, "which digit ?", "--method", "nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err
    assert main(["vlm", "ask", "--image", str(tmp_path / "missing.png"), "--run", str(run), "which digit ?"]) == 2
    assert "missing.png" in capsys.readouterr().err
    assert main(["vlm", "ask", "--image", str(path), "--run", str(tmp_path), "which digit ?"]) == 2
    assert "has no model.safetensors" in capsys.readouterr().err


def test_viz_vlm_draws_the_kept_tokens_and_the_attention(run: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out, attention = tmp_path / "kept.png", tmp_path / "attention.png"
    args = ["viz", "vlm", "--run", str(run), "--method", "random", "--keep", "0.125", "--out", str(out)]
    assert main([*args, "--attention", str(attention)]) == 0
    assert PIL.open(out).size[0] > 100 and PIL.open(attention).size[0] > 100


def test_demo_vlm_refuses_retraining_options_without_retrain(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "vlm", "--ship-to", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    assert "--ship-to" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert main(["demo", "vlm", "--seed", "1", "--out", str(tmp_path / "run")]) == 2
    assert "--seed 1 needs --retrain" in capsys.readouterr().err
