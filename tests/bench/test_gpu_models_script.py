"""benchmarks/gpu_models.py cannot rot: its CPU smoke run (tiny models) makes every kind of row, the authors' pairs,
the profiles, the JSON and the markdown table that the GPU run fills."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_models.py"


def run_script(tmp_path: Path, *extra: str) -> dict:
    spec = importlib.util.spec_from_file_location("gpu_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--small", "--out", str(tmp_path), *extra]) == 0
    assert "| setting | GFLOPs |" in (tmp_path / "gpu_models.md").read_text()
    return json.loads((tmp_path / "gpu_models.json").read_text())


@pytest.mark.full  # 30 s on 2 cores: the script itself needs a GPU; this smoke run is for CI's make test-all
def test_smoke_run_makes_every_kind_of_row(tmp_path: Path) -> None:
    results = run_script(tmp_path, "--reducers", "tome,dynamicvit")
    (table,) = results["tables"].values()
    assert set(table["rows"]) == {"dense", "tome", "dynamicvit"}
    for row in table["rows"].values():
        assert {"eager_1", "graph_1", "eager_2", "graph_2"} <= set(row)
        assert row["gflops"] > 0 and row["graph_2"]["img_s"] > 0
    assert table["rows"]["dense"]["eager_1"]["speedup"] == 1.0
    for method in ("ToMe", "DynamicViT"):
        pair = results["authors"][method]
        assert pair["max_logit_diff_fp32"] < 1e-4  # the same model, written twice
        assert {"eager_1", "compiled_1", "eager_2", "compiled_2"} <= set(pair)
    assert len(results["profiles"]) == 6 and all(len(ops) == 15 for ops in results["profiles"].values())
    assert results["skipped"] == []


@pytest.mark.full
def test_smoke_run_with_every_reducer(tmp_path: Path) -> None:
    results = run_script(tmp_path)
    (table,) = results["tables"].values()
    assert len(table["rows"]) >= 11
