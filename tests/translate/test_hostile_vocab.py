"""Issue 34: a translation run folder may come from anyone; its ``vocab.json`` is read as data and checked against
the model beside it (the shipped run, copied and rewritten one field at a time)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vitrim.demos.translate.inference import load_run
from vitrim.shipped import shipped_run


@pytest.fixture
def run_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("model.safetensors", "vocab.json"):
        shutil.copy(shipped_run("translate") / name, folder / name)
    return folder


def test_the_shipped_vocab_loads(run_copy: Path) -> None:
    run = load_run(run_copy)
    assert run.languages == ["de", "fr"] and 0 <= run.alignment_layer < run.model.config.decoder_depth


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"source": 5}, "source must be a list of 1 to"),
        ({"target": ["a", 7]}, "target must be a list of 1 to"),
        ({"languages": ["xx"]}, "languages must be a non-empty list"),
        ({"languages": "de"}, "languages must be a non-empty list"),
        ({"alignment_layer": "abc"}, "alignment_layer must be an int"),
        ({"alignment_layer": 99}, "alignment_layer 99 is not a decoder layer"),
        ({"source": ["one", "two"]}, "the source vocabulary has 3 tokens"),  # ids past the list: not one run
    ],
)
def test_hostile_vocab_fields_are_one_clear_error(run_copy: Path, change: dict, words: str) -> None:
    path = run_copy / "vocab.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ValueError) as err:
        load_run(run_copy)
    assert words in str(err.value) and "vocab.json" in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.parametrize(
    ("text", "words"), [("[" * 100000 + "]" * 100000, "nested"), ("[]", "expected a JSON object"), ("{", "not valid")]
)
def test_vocab_json_is_read_through_untrusted(run_copy: Path, text: str, words: str) -> None:
    (run_copy / "vocab.json").write_text(text)
    with pytest.raises(ValueError, match=words):
        load_run(run_copy)
