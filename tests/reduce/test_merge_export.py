"""The merging methods export to ONNX (gathers and dense assignment products, no scatter_reduce mean).

MCTF is exported by the sweep of every reducer in tests/deploy/test_onnx.py (its default, one-step-ahead setting).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from reduce_models import tiny

import vitrim
from vitrim.export import compare_with_onnxruntime, export_onnx


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("pitome", {"ratio": 0.8}),
        ("ppt", {"r": 4, "layers": (1, 2), "threshold": 1.0}),  # every image pools (proportional attention on)
        ("ppt", {"r": 4, "layers": (1, 2), "threshold": 0.0}),  # every image prunes
        ("zero_tprune", {"keep_rate": 0.6, "layers": (1, 2)}),  # WPR iterations and the S-stage, static counts
        ("diffrate", {"prune_kept": [17, 15, 12, 9], "merge_kept": [17, 13, 10, 8]}),  # prune, then merge
    ],
)
def test_onnx_export_matches_eager(name: str, options: dict[str, object], tmp_path: Path) -> None:
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    model = vitrim.reduce.apply(tiny(), name, **options)
    path = export_onnx(model, tmp_path / f"{name}.onnx")
    assert compare_with_onnxruntime(model, path, batch_sizes=(1, 2)) < 1e-5
