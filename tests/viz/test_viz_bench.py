"""``vitrim viz rollout-memory``: runs end to end on a tiny input and reports what it measured."""

from __future__ import annotations

import json

import pytest

from vitrim.cli import main


def test_rollout_memory_reports_peak_growth(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["viz", "rollout-memory", "--model", "vit_tiny_patch16_224", "--img-size", "32", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "N=5" in text and "stream: peak RSS growth" in text
    result = json.loads(out.read_text())
    assert result["tokens"] == 5  # (32 / 16)² patches + [CLS]
    assert result["one_map_mb"] == pytest.approx(3 * 5 * 5 * 4 / 2**20)  # B · H · N² · 4 bytes
    assert result["stream"]["peak_mb"] >= 0 and result["stream"]["seconds"] > 0


def test_rollout_memory_rejects_unknown_modes(capsys):
    assert main(["viz", "rollout-memory", "--modes", "stream,fast"]) == 2
    assert "--modes must be a comma-separated subset of ('stream', 'all')" in capsys.readouterr().err
