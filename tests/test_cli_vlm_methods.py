"""``vitrim vlm methods``: every registered method under its stage, with exactly its own options and defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vitrim.cli import main
from vitrim.vlm import method_info, methods
from vitrim.vlm.method import STAGES


def _listing(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert main(["vlm", "methods", *args]) == 0
    return capsys.readouterr().out


def test_every_method_is_listed_under_its_stage_with_its_defaults(capsys: pytest.CaptureFixture) -> None:
    out = _listing(capsys)
    stage_of_line, stage = {}, None
    for line in out.splitlines():
        if line and not line.startswith(" "):
            stage = line.split(":")[0]
        elif line.startswith("  ") and not line.startswith("    "):
            stage_of_line[line.split()[0]] = (stage, line)
    assert sorted(stage_of_line) == methods()
    for name in methods():
        info = method_info(name)
        listed_stage, line = stage_of_line[name]
        assert listed_stage == info.stage, name
        for option, default in info.defaults.items():
            shown = option if default is None else f"{option}={default!r}"
            assert shown in line, f"{name}: {shown} not in {line!r}"
    assert "pdrop         layers=(8, 16, 24), ratios=(0.5, 0.25, 0.125)" in out  # PyramidDrop's paper defaults
    assert "visionzip     dominant=54, contextual=10, cls, positions='authors', keep=64 when not given" in out
    assert "fastv         layer=2 when not given, keep=0.5 when not given" in out  # FastV's K = 2, R = 50 %
    assert [line.split(":")[0] for line in out.splitlines() if line and not line[0].isspace()] == list(STAGES)


def test_one_stage_and_json(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    out = _listing(capsys, "--stage", "in_llm", "--json", str(tmp_path / "m.json"))
    expected = methods(stage="in_llm")
    assert [line.split()[0] for line in out.splitlines() if line.startswith("  ") and line[2] != " "] == expected
    rows = json.loads((tmp_path / "m.json").read_text())
    assert [r["name"] for r in rows] == expected
    assert {r["name"]: r["options"] for r in rows}["pdrop"] == {"layers": [8, 16, 24], "ratios": [0.5, 0.25, 0.125]}


def test_an_unknown_stage_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["vlm", "methods", "--stage", "decoder"]) == 2
    assert "--stage must be one of pre_llm, in_llm, tower; got 'decoder'" in capsys.readouterr().err
