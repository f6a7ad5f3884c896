"""``vitrim models [PATTERN]`` lists the registry; no match is a one-line error with exit code 2."""

from __future__ import annotations

import pytest

import vitrim
from vitrim.cli import main


def test_lists_every_model_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    assert capsys.readouterr().out.split() == vitrim.list_models()


def test_pattern_filters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "deit_*distilled*"]) == 0
    sizes = ("base", "small", "tiny")
    assert capsys.readouterr().out.split() == [f"deit_{size}_distilled_patch16_224" for size in sizes]


def test_no_match_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "resnet*"]) == 2
    err = capsys.readouterr().err
    assert err == "vitrim: error: no registered model matches 'resnet*'; run `vitrim models` to see them all\n"
