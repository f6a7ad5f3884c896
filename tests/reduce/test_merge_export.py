"""The merging methods export to ONNX (gathers and dense assignment products, no scatter_reduce mean).

Every reducer's example setting (PiToMe, DiffRate's prune-then-merge, MCTF's one-step-ahead, …) is exported by the
sweep in tests/deploy/test_onnx.py; these are the settings that take other paths.
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
        # every image pools (proportional attention on); 25 s on the shared machine, make test-all
        pytest.param("ppt", {"r": 4, "layers": (1, 2), "threshold": 1.0}, marks=pytest.mark.full),
        pytest.param("ppt", {"r": 4, "layers": (1, 2), "threshold": 0.0}, marks=pytest.mark.full),  # every image prunes
        pytest.param("zero_tprune", {"keep_rate": 0.6, "layers": (1, 2)}, marks=pytest.mark.full),  # WPR, S-stage
    ],
)
def test_onnx_export_matches_eager(name: str, options: dict[str, object], tmp_path: Path) -> None:
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    model = vitrim.reduce.apply(tiny(), name, **options)
    path = export_onnx(model, tmp_path / f"{name}.onnx")
    assert compare_with_onnxruntime(model, path, batch_sizes=(1, 2)) < 1e-5
