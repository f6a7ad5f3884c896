"""The sweep's random baselines: the mean over BASELINE_SEEDS (five seeds or more), each seed's accuracy kept, each
equal to that seed's trimmed model scored alone."""

from __future__ import annotations

import copy
import statistics

import pytest

pytest.importorskip("transformers")

from vitrim import vlm
from vitrim.demos.vlm.demo import QUICK
from vitrim.demos.vlm.evaluate import held_out, score
from vitrim.demos.vlm.model import build_model, digits_vlm_config
from vitrim.demos.vlm.sweep import BASELINE_SEEDS, SEEDED_BASELINES, run_sweep


@pytest.mark.parametrize("method", SEEDED_BASELINES)
def test_a_seeded_baseline_is_the_mean_of_its_seeds(method: str) -> None:
    model = build_model(digits_vlm_config(QUICK.vision, QUICK.text), seed=2)
    data = held_out(8)
    row = run_sweep(model, data, [method], timing_batch=2, repeats=1).methods[method]["0.25"]
    assert len(BASELINE_SEEDS) >= 5 and len(set(BASELINE_SEEDS)) == len(BASELINE_SEEDS)
    for seed, recorded in zip(BASELINE_SEEDS, row["accuracy_by_seed"], strict=True):
        alone, _ = score(vlm.apply(copy.deepcopy(model), method, keep=0.25, seed=seed), data)
        assert recorded == alone, seed
    kept = []
    for seed in BASELINE_SEEDS[:2]:
        trimmed = vlm.apply(copy.deepcopy(model), method, keep=0.25, seed=seed)
        score(trimmed, data)
        kept.append([t.tolist() for t in vlm.last_selection(trimmed)])
    assert kept[0] != kept[1]  # the seed reaches the draw
    for kind, mean in row["accuracy"].items():
        assert mean == pytest.approx(statistics.fmean(one[kind] for one in row["accuracy_by_seed"]))
