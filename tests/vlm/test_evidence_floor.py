"""The evidence floor (``vitrim.vlm.evidence``) is pure torch, and its video view cuts a clip into temporal patches."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from vitrim.vlm.evidence.merged_tokens import temporal_patches

EVIDENCE = Path(__file__).resolve().parents[2] / "src" / "vitrim" / "vlm" / "evidence"


def test_the_evidence_floor_imports_torch_and_the_standard_library_only() -> None:
    imported = set()
    for path in EVIDENCE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
    foreign = {name for name in imported if name not in sys.stdlib_module_names and name not in {"torch", "vitrim"}}
    assert not foreign, foreign
    assert len(list(EVIDENCE.glob("*.py"))) >= 6  # the check above read the floor's files


def test_temporal_patches_are_the_raster_rows_of_each_time_step() -> None:
    # a video of 3 temporal patches of 4 x 6 patches, merge 2: 3 rows of 2 x 3 = 6 merged tokens, raster (t, h, w)
    tokens = torch.arange(3 * 6).view(18, 1).float()
    rows = temporal_patches(tokens, (3, 4, 6), 2)
    assert rows.shape == (3, 6, 1)
    assert rows[1, :, 0].tolist() == list(range(6, 12))  # the second temporal patch, whole, in raster order


def test_temporal_patches_refuse_a_grid_that_does_not_hold_the_tokens() -> None:
    with pytest.raises(ValueError, match=r"a video of grid \(2, 4, 6\) \(merge 2\) has 12 tokens; got 18"):
        temporal_patches(torch.zeros(18, 1), (2, 4, 6), 2)
