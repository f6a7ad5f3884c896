"""The attention benchmark: vitrim's backends against torch's SDPA in the same run (``vitrim bench attention``).

Times are medians of repeats after warm-up; ratios are against torch SDPA measured in the same process. Peak
memory is the growth of the process's peak resident set, each case in a fresh process (:mod:`vitrim.bench.memory`)
so that no other case's high-water mark hides it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vitrim.attention import scaled_dot_product_attention
from vitrim.bench.memory import measure_in_fresh_process, peak_rss_bytes
from vitrim.bench.timing import time_case

CASES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
    "torch_sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    "vitrim_auto": lambda q, k, v: scaled_dot_product_attention(q, k, v),
    "vitrim_weights": lambda q, k, v: scaled_dot_product_attention(q, k, v, need_weights=True),
    "plain_matmul_softmax": lambda q, k, v: torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, -1) @ v,
}


def inputs(batch: int, heads: int, length: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Fixed random q, k, v of shape (batch, heads, length, head_dim)."""
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(batch, heads, length, head_dim, generator=g) for _ in range(3))


def time_cases(batch: int, heads: int, head_dim: int, length: int, repeats: int = 0) -> dict[str, float]:
    """Median seconds of every case at one length (``repeats`` 0: chosen by length)."""
    q, k, v = inputs(batch, heads, length, head_dim)
    repeats = repeats or (30 if length <= 256 else 10 if length <= 1024 else 3)
    return {name: time_case(functools.partial(fn, q, k, v), repeats) for name, fn in CASES.items()}


def case_memory(case: str, batch: int, heads: int, head_dim: int, length: int) -> dict[str, int]:
    """Peak-RSS growth (bytes) of one case, measured in this process (call it through a fresh one)."""
    q, k, v = inputs(batch, heads, length, head_dim)
    fn = CASES[case]
    with torch.inference_mode():
        fn(q[:, :, :8], k[:, :, :8], v[:, :, :8])  # load kernels before the baseline is read
        before = peak_rss_bytes()
        fn(q, k, v)
        return {"peak_bytes": peak_rss_bytes() - before}


def memory_mb(case: str, batch: int, heads: int, head_dim: int, length: int) -> float:
    """Peak-RSS growth of one case in MiB, in a fresh process."""
    args = dict(case=case, batch=batch, heads=heads, head_dim=head_dim, length=length)
    return measure_in_fresh_process(case_memory, **args)["peak_bytes"] / 2**20
