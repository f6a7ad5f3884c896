"""``vitrim vlm ask``, ``vitrim viz vlm``, ``vitrim demo vlm``: answers as the library gives them, one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from vitrim import vlm  # noqa: E402
from vitrim.cli import main  # noqa: E402
from vitrim.cli.common import in_flags  # noqa: E402
from vitrim.demos.vlm.ask import ask, read_canvas  # noqa: E402
from vitrim.demos.vlm.demo import QUICK  # noqa: E402
from vitrim.demos.vlm.evaluate import answer, held_out  # noqa: E402
from vitrim.demos.vlm.model import build_model, digits_vlm_config, save_model  # noqa: E402
from vitrim.demos.vlm.run_folder import load_digits_vlm  # noqa: E402
from vitrim.demos.vlm.sweep import apply_method, available_methods  # noqa: E402
from vitrim.demos.vlm.words import split_words  # noqa: E402


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
    from vitrim.demos.vlm.run_folder import load_digits_vlm

    expected = ask(load_digits_vlm(run), canvas, "how many digits ?").text
    assert main(["vlm", "ask", "--image", str(path), "--run", str(run), "how many digits"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == expected


def test_ask_with_a_method_reports_the_tokens_it_kept(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _png(tmp_path, held_out(1).pixels[0], paper=False)
    args = ["vlm", "ask", "--image", str(path), "--run", str(run), "which digit ?", "--method", "random", "--keep", "8"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("random (before the LLM): 8 of 64 image tokens entered the LLM, patches [")


# One method per stage (and one the sweep cannot run) in the default suite; every method under `full`.
DEFAULT_METHODS = ("random", "pdrop", "tome", "pitome")


@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=[] if m in DEFAULT_METHODS else [pytest.mark.full]) for m in available_methods()]
)
def test_ask_runs_every_method_with_the_options_the_demo_sweeps_it_with(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, method: str
) -> None:
    """The command's answer and kept tokens are those of the sweep's model for that method at keep 0.125 (PyramidDrop's
    stages, FastV's layer: vitrim.demos.vlm.sweep); a method the sweep records as not run is refused in one line."""
    path = _png(tmp_path, held_out(1).pixels[0], paper=False)
    canvas = read_canvas(path)  # the pixels the command sees (8-bit): the random method's seed is drawn from them
    args = ["vlm", "ask", "--image", str(path), "--run", str(run), "where is the one ?", "--method", method]
    try:
        pruned = apply_method(load_digits_vlm(run), method, "0.125")
    except (ValueError, TypeError) as err:
        assert main([*args, "--keep", "0.125"]) == 2
        assert capsys.readouterr().err.strip() == f"vitrim: error: {in_flags(str(err))}"
        return
    expected = answer(pruned, canvas[None], [split_words("where is the one ?")])[0]
    kept = vlm.last_selection(pruned)[0].tolist()
    assert main([*args, "--keep", "0.125"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == expected
    assert lines[1].startswith(f"{method} (") and lines[1].split("patches ")[1].split("]")[0] + "]" == str(kept)


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


def test_viz_vlm_saves_the_canvas_it_draws_for_vlm_ask(run: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    canvas_png = tmp_path / "digit.png"
    args = ["viz", "vlm", "--run", str(run), "--canvas", "3", "--method", "random", "--out", str(tmp_path / "k.png")]
    assert main([*args, "--save-canvas", str(canvas_png)]) == 0
    assert np.abs(read_canvas(canvas_png) - held_out(4).pixels[3]).max() <= 1 / 255 + 1e-6


@pytest.mark.full
def test_viz_vlm_draws_every_method_the_sweep_runs_and_names_the_others(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("matplotlib")
    refused = []
    for method in available_methods():
        try:
            apply_method(load_digits_vlm(run), method, "0.125")
        except (ValueError, TypeError):
            refused.append(method)
    args = ["viz", "vlm", "--run", str(run), "--canvas", "3", "--keep", "0.125", "--out", str(tmp_path / "k.png")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert [line.split()[2] for line in out.splitlines() if line.startswith("not drawn:")] == refused
    assert PIL.open(tmp_path / "k.png").size[0] > 100


def test_demo_vlm_refuses_retraining_options_without_retrain(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "vlm", "--ship-to", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    assert "--ship-to" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert main(["demo", "vlm", "--seed", "1", "--out", str(tmp_path / "run")]) == 2
    assert "--seed 1 needs --retrain" in capsys.readouterr().err
