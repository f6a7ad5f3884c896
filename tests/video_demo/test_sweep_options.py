"""What the video demo's sweep asks of each method at 50 / 25 / 12.5 % of the 64 video tokens, and the tokens each
then keeps (counted from ``last_selection``; the counts are the methods' own formulas, docs/video.md's table)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from vitrim.demos.video.demo import QUICK
from vitrim.demos.video.evaluate import held_out
from vitrim.demos.video.model import build_model, video_model_config
from vitrim.demos.video.sweep import apply_method, check_methods, kept_tokens, video_options
from vitrim.demos.video.words import processor

FRACTIONS = ("0.5", "0.25", "0.125")
# per method: the options at each fraction, and the video tokens (of 64: 4 temporal patches of P = 16) it keeps
EXPECTED = {
    "evs": ([{"video_pruning_rate": 0.5}, {"video_pruning_rate": 0.75}, {"video_pruning_rate": 0.875}], [32, 16, 16]),
    "vidcom2": ([{"video_pruning_rate": r} for r in (0.5, 0.75, 0.875)], [32, 16, 8]),
    "temporal_downsample": ([{"stride": 2}, {"stride": 4}, {"stride": 8}], [32, 16, 16]),
    "fastvid": ([{"retention_ratio": r} for r in (0.5, 0.25, 0.125)], [32, 16, 8]),
    "flashvid": ([{"retention_ratio": r / 1.25} for r in (0.5, 0.25, 0.125)], [32, 16, 8]),
    "random": ([{"keep": r} for r in (0.5, 0.25, 0.125)], [32, 16, 8]),
    "visionzip": ([{"keep": r} for r in (0.5, 0.25, 0.125)], [32, 16, 8]),
    "fastv": ([{"keep": r, "layer": 2} for r in (0.5, 0.25, 0.125)], [32, 16, 8]),  # from layer 2 on
}


@pytest.fixture(scope="module")
def model_and_inputs():
    data = held_out(2)
    inputs = processor(data.frames[[0, 1]], [data.questions[0].words, data.questions[4].words])
    return build_model(video_model_config(QUICK.vision, QUICK.text), seed=1), inputs


@pytest.mark.parametrize(
    ("method", "fraction"),
    [
        pytest.param(m, f, marks=() if f == "0.125" else pytest.mark.full)  # 12.5 %: where the counts differ most
        for m in EXPECTED
        for f in FRACTIONS
    ],
)
def test_each_method_gets_its_own_options_and_keeps_what_they_say(method: str, fraction: str, model_and_inputs) -> None:
    model, inputs = model_and_inputs
    options, kept = EXPECTED[method]
    at = FRACTIONS.index(fraction)
    assert video_options(method, fraction) == pytest.approx(options[at])
    pruned = apply_method(model, method, fraction)
    assert kept_tokens(pruned, inputs) == kept[at]


def test_a_seeded_baseline_passes_its_seed_and_unknown_methods_are_one_line() -> None:
    assert video_options("random", "0.25", seed=3) == {"keep": 0.25, "seed": 3}
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['bogus'\]"):
        check_methods(["evs", "bogus"])
    with pytest.raises(ValueError, match="methods is empty"):
        check_methods([])
    assert "flashvid_llm" not in check_methods(None) and {"evs", "vidcom2", "fastvid"} <= set(check_methods(None))
    assert np.isclose(video_options("flashvid", "0.5")["retention_ratio"], 0.4)
