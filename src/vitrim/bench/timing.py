"""Wall-clock timing shared by the benchmarks: warm-up, repeats, median and percentiles."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch


def time_samples(fn: Callable[[], object], repeats: int, warmup: int = 2) -> list[float]:
    """Wall time of each of ``repeats`` calls of ``fn`` in seconds, after ``warmup`` untimed calls (inference mode)."""
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return times


def time_case(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in seconds, after ``warmup`` untimed calls."""
    return statistics.median(time_samples(fn, repeats, warmup))


def interleaved_samples(fns: Sequence[Callable[[], object]], repeats: int, warmup: int = 2) -> list[list[float]]:
    """Like :func:`time_samples` for several functions, called in turn within each repeat.

    On a shared machine the load changes from second to second; taking turns gives every function the same
    conditions, so that a ratio of their medians means something.
    """
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    samples: list[list[float]] = [[] for _ in fns]
    with torch.inference_mode():
        for fn in fns:
            for _ in range(warmup):
                fn()
        for _ in range(repeats):
            for fn, times in zip(fns, samples):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
    return samples


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 … 100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
