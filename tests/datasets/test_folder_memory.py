"""Streamed folders: the peak memory of ``vitrim eval`` does not grow with the folder (benchmarks/data_memory.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from data_memory import make_checkpoint, make_folder, measure


def _peaks(tmp_path: Path, small: int, large: int) -> tuple[dict, dict]:
    checkpoint = make_checkpoint(tmp_path / "tiny.safetensors")
    rows = []
    for size in (small, large):
        folder = make_folder(tmp_path / f"folder_{size}", size)
        rows.append(measure(checkpoint, folder, workers=2, batch_size=64, report=tmp_path / f"{size}.json"))
    assert [row["images"] for row in rows] == [small, large] and all(row["code"] == 0 for row in rows)
    return rows[0], rows[1]


@pytest.mark.full  # two evaluations in fresh processes, 20 s on the shared machine
def test_ten_times_the_images_costs_no_more_memory(tmp_path: Path) -> None:
    small, large = _peaks(tmp_path, 200, 2000)
    assert large["main_mib"] < 1.1 * small["main_mib"]
    assert large["worker_mib"] < 1.1 * small["worker_mib"]


@pytest.mark.full
def test_twenty_thousand_images_cost_what_two_thousand_do(tmp_path: Path) -> None:
    small, large = _peaks(tmp_path, 2000, 20000)
    assert large["main_mib"] < 1.1 * small["main_mib"]
    assert large["worker_mib"] < 1.1 * small["worker_mib"]
