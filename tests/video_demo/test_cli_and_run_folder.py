"""``vitrim demo video``'s bad arguments, and a run folder read as files from anyone: each problem one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from vitrim.cli import main
from vitrim.demos.video.demo import QUICK
from vitrim.demos.video.model import build_model, video_model_config
from vitrim.demos.video.run_folder import load_video_model
from vitrim.demos.vlm.model import save_model


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "bogus"], "unknown method(s) ['bogus'] of vitrim.vlm for the video demo"),
        (["--methods", ","], "--methods is empty"),
        (["--seed", "3"], "--seed 3 needs --retrain or --quick"),
        (["--ship-to", "X"], "--ship-to 'X' needs --retrain"),
        (["--quick", "--retrain", "--ship-to", "X"], "--ship-to 'X' ships the FULL recipe; --quick trains a plumbing"),
    ],
)
def test_demo_video_bad_arguments_are_one_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = [str(tmp_path / a) if a == "X" else a for a in args]
    assert main(["demo", "video", "--out", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("vitrim: error: ")
    assert message.replace("'X'", repr(str(tmp_path / "X"))) in err
    assert not (tmp_path / "run").exists()  # refused before any work


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("video_run")
    save_model(build_model(video_model_config(QUICK.vision, QUICK.text), seed=2), folder)
    return folder


def _edited(run: Path, tmp_path: Path, part: str, key: str, value: object) -> Path:
    config = json.loads((run / "config.json").read_text())
    (config[part] if part else config)[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes())
    return tmp_path


@pytest.mark.parametrize(
    ("part", "key", "value", "message"),
    [
        ("", "video_token_id", 9, "video_token_id is 9, expected 4"),
        ("vision_config", "temporal_patch_size", 1, "temporal_patch_size is 1, expected 2"),
        ("text_config", "vocab_size", 99, "vocab_size is 99, expected 32"),
        ("text_config", "rope_parameters", {"rope_type": "default", "mrope_section": [4, 6, 7]}, "mrope_section"),
        ("vision_config", "embed_dim", 32, "but its config.json makes it"),  # the weights are 16 wide
    ],
)
def test_a_bad_run_folder_is_one_line(
    run: Path, tmp_path: Path, part: str, key: str, value: object, message: str
) -> None:
    folder = _edited(run, tmp_path, part, key, value)
    with pytest.raises(ValueError, match=r"config\.json|model\.safetensors") as caught:
        load_video_model(folder)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_good_run_folder_loads_and_answers(run: Path) -> None:
    model = load_video_model(run)
    assert model.config.video_token_id == 4 and not model.training
