"""``vitrim bench attention``: vitrim's backends against torch's SDPA in the same run.

Times are medians of repeats after warm-up; ratios are against torch SDPA measured in the same process. Peak
memory is the growth of the process's peak resident set, each case in a fresh subprocess so that no other case's
high-water mark hides it.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vitrim.attention import scaled_dot_product_attention
from vitrim.bench.allocator import pin_malloc_threshold
from vitrim.bench.timing import time_case

CASES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
    "torch_sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    "vitrim_auto": lambda q, k, v: scaled_dot_product_attention(q, k, v),
    "vitrim_weights": lambda q, k, v: scaled_dot_product_attention(q, k, v, need_weights=True),
    "plain_matmul_softmax": lambda q, k, v: torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, -1) @ v,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("attention", help="auto vs math vs torch SDPA, float32, this machine")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--lengths", default="197,1024,4096", help="comma-separated sequence lengths N")
    parser.add_argument("--repeats", type=int, default=0, help="timed repeats per case (0: chosen per N)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--memory-length", type=int, default=4096, help="N at which peak memory is measured")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.set_defaults(func=run)
    # Internal: measure one case's peak memory in this (fresh) process and print it.
    parser.add_argument("--_memory-case", dest="memory_case", default=None, help=argparse.SUPPRESS)


def _inputs(batch: int, heads: int, length: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(batch, heads, length, head_dim, generator=g) for _ in range(3))


def _peak_rss_bytes() -> int:
    """This process's peak resident set in bytes.

    Linux carries ``ru_maxrss`` over fork and exec, so a child of a large parent would report the parent's peak
    (and every case would seem to grow by 0). ``VmHWM`` belongs to the process's own address space; use it when
    there is one.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _measure_memory_here(args: argparse.Namespace) -> int:
    q, k, v = _inputs(args.batch, args.heads, args.memory_length, args.head_dim)
    fn = CASES[args.memory_case]
    with torch.inference_mode():
        fn(q[:, :, :8], k[:, :, :8], v[:, :, :8])  # load kernels before the baseline is read
        before = _peak_rss_bytes()
        fn(q, k, v)
        print(_peak_rss_bytes() - before)
    return 0


def _measure_memory(args: argparse.Namespace, case: str) -> int:
    cmd = [sys.executable, "-m", "vitrim.cli", "bench", "attention", "--_memory-case", case]
    cmd += ["--batch", str(args.batch), "--heads", str(args.heads), "--head-dim", str(args.head_dim)]
    cmd += ["--memory-length", str(args.memory_length), "--threads", str(args.threads)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(result.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    for name in ("batch", "heads", "head_dim"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.memory_case is not None:
        return _measure_memory_here(args)
    pin_malloc_threshold()
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    print(f"attention, float32, B={args.batch}, H={args.heads}, d={args.head_dim}, {torch.get_num_threads()} threads")
    print("median ms (ratio to torch SDPA)")
    header = f"{'N':>6} " + " ".join(f"{name:>24}" for name in CASES)
    print(header)
    config = {key: value for key, value in vars(args).items() if key not in ("func", "memory_case")}
    results: dict[str, dict] = {"config": config | {"threads": torch.get_num_threads()}, "times_ms": {}}
    for length in lengths:
        q, k, v = _inputs(args.batch, args.heads, length, args.head_dim)
        repeats = args.repeats or (30 if length <= 256 else 10 if length <= 1024 else 3)
        times = {name: time_case(functools.partial(fn, q, k, v), repeats) for name, fn in CASES.items()}
        base = times["torch_sdpa"]
        results["times_ms"][length] = {name: t * 1e3 for name, t in times.items()}
        print(f"{length:>6} " + " ".join(f"{t * 1e3:>14.2f} ({t / base:5.2f}x)" for t in times.values()))
    if args.memory_length > 0:
        print(f"peak memory growth at N={args.memory_length} (fresh process per case):")
        results["peak_memory_mb"] = {}
        for name in CASES:
            mb = _measure_memory(args, name) / 2**20
            results["peak_memory_mb"][name] = mb
            print(f"  {name:>24}: {mb:9.1f} MiB")
        n = args.memory_length
        matrix_mb = args.batch * args.heads * n * n * 4 / 2**20
        print(f"  (one float32 N x N attention matrix for all heads: {matrix_mb:.1f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
