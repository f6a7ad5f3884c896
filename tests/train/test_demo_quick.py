"""``vitrim demo --quick``: the whole pipeline end to end on tiny models; FLOPs checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vitrim.cli import main


def test_quick_demo_writes_report_and_summary(tmp_path: Path) -> None:
    assert main(["demo", "--quick", "--quiet", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name in ("dense", "dynamicvit", "cnn"):
        row = summary[name]
        assert {"top1", "gflops", "images_per_s"} <= set(row)
        assert 0.0 <= row["top1"] <= 1.0 and row["images_per_s"] > 0
    # dense quick ViT: 16 tokens (16x16 image, patch 4, no [CLS]), D = 16, 2 blocks, MLP 4x; 2 FLOPs per multiply-add
    N, D, C = 16, 16, 10
    block = 2 * N * (D * 3 * D + D * D + 2 * D * 4 * D) + 2 * 2 * N * N * D  # qkv, proj, fc1+fc2; QK^T and A.V
    dense = 2 * N * (4 * 4 * 1) * D + 2 * block + 2 * D * C  # patch embed + blocks + head
    assert summary["dense"]["gflops"] == pytest.approx(dense / 1e9)
    # quick CNN, widths (8, 16) on 1x16x16: two 3x3 convs per stage, the second stage at 8x8
    cnn = 2 * 9 * (1 * 8 + 8 * 8) * 256 + 2 * 9 * (8 * 16 + 16 * 16) * 64 + 2 * 16 * C
    assert summary["cnn"]["gflops"] == pytest.approx(cnn / 1e9)
    assert summary["dynamicvit"]["gflops"] < summary["dense"]["gflops"]  # pruned tokens are really gone
    # the registered ViT is the trained dense ViT with registers added, not a second ViT from scratch
    record = json.loads((tmp_path / "dense_reg" / "run.json").read_text())
    assert record["overrides"]["checkpoint"] == str(tmp_path / "dense" / "last.safetensors")
    assert record["overrides"]["reg_tokens"] == 2 and "kept_per_stage" in summary["dynamicvit_reg"]
    report = (tmp_path / "report.md").read_text()
    assert "| model | top-1 | GFLOPs / image | images/s | speed-up vs dense |" in report
    for picture in ("kept_tokens_0.png", "accuracy_vs_speed.png"):
        assert (tmp_path / picture).stat().st_size > 1000 and f"({picture})" in report
