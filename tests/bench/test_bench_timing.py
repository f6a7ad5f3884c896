"""Timing helpers: percentiles against torch.quantile, turn-taking order, argument errors."""

from __future__ import annotations

import pytest
import torch

from vitrim.bench.timing import interleaved_samples, percentile, time_case, time_samples


@pytest.mark.parametrize("q", [0, 5, 50, 95, 100, 37.5])
@pytest.mark.parametrize("n", [1, 2, 7, 30])
def test_percentile_matches_torch_quantile(q, n):
    values = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    expected = torch.quantile(values, q / 100, interpolation="linear").item()
    assert percentile(values.tolist(), q) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_percentile_by_hand():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted input; between the 2nd and 3rd values
    assert percentile([10.0, 20.0], 95) == pytest.approx(19.5)


def test_interleaved_samples_take_turns_after_warmup():
    calls: list[str] = []
    a_samples, b_samples = interleaved_samples([lambda: calls.append("a"), lambda: calls.append("b")], 3, warmup=2)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert len(a_samples) == len(b_samples) == 3
    assert all(t >= 0 for t in a_samples + b_samples)


def test_samples_run_in_inference_mode():
    seen: list[bool] = []
    time_samples(lambda: seen.append(torch.is_inference_mode_enabled()), 2, warmup=1)
    assert seen == [True, True, True]


@pytest.mark.parametrize(("repeats", "warmup", "match"), [(0, 1, "repeats must be positive"), (1, -1, "warmup")])
def test_bad_arguments(repeats, warmup, match):
    with pytest.raises(ValueError, match=match):
        time_case(lambda: None, repeats, warmup)
    with pytest.raises(ValueError, match=match):
        interleaved_samples([lambda: None], repeats, warmup)
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
