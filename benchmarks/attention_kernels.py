"""Where the explicit matrix beats torch's fused kernel on CPU: the measurement behind vitrim's kernel choice.

    PYTHONPATH=src python benchmarks/attention_kernels.py --threads 2

For the shapes a ViT-S forward meets (H = 6, head 64; N from 197 down to 41 as ToMe merges; DynamicViT's 197, 138,
97, 68), with and without ToMe's (B, 1, 1, N) log-size bias, it times ``vitrim.scaled_dot_product_attention`` with
``backend="fused"`` and ``backend="math"`` in alternating rounds and prints the median of the per-round ratios
math / fused (below 1: the explicit matrix is faster), with B·H·N² (the logits the math path writes) beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import vitrim
from vitrim.bench.allocator import pin_malloc_threshold


def ratio(batch: int, n: int, bias: bool, rounds: int, heads: int = 6, dim: int = 64) -> tuple[float, float, float]:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=g) for _ in range(3))
    mask = torch.rand(batch, 1, 1, n, generator=g).add(0.5).log() if bias else None
    times: dict[str, list[float]] = {"fused": [], "math": []}
    with torch.inference_mode():
        for backend in times:
            for _ in range(3):
                vitrim.scaled_dot_product_attention(q, k, v, mask, backend=backend)  # type: ignore[arg-type]
        for i in range(rounds):
            for backend in ("fused", "math") if i % 2 == 0 else ("math", "fused"):
                start = time.perf_counter()
                vitrim.scaled_dot_product_attention(q, k, v, mask, backend=backend)  # type: ignore[arg-type]
                times[backend].append(time.perf_counter() - start)
    ratios = [m / f for m, f in zip(times["math"], times["fused"])]
    return statistics.median(ratios), 1e6 * statistics.median(times["fused"]), 1e6 * statistics.median(times["math"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,4,8,32")
    parser.add_argument("--lengths", default="197,138,97,68,41")
    parser.add_argument("--rounds", type=int, default=0, help="0: 200 at B=1, fewer for larger batches")
    args = parser.parse_args()
    pin_malloc_threshold()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; ratio = math / fused (median of paired rounds)")
    print(f"{'B':>3} {'N':>4} {'bias':>5} {'B*H*N^2':>10} {'fused us':>9} {'math us':>9} {'ratio':>6}")
    for batch in (int(b) for b in args.batches.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            for bias in (False, True):
                rounds = args.rounds or max(10, 200 // batch)
                r, fused, math = ratio(batch, n, bias, rounds)
                print(
                    f"{batch:>3} {n:>4} {bias!s:>5} {batch * 6 * n * n:>10} {fused:9.1f} {math:9.1f} {r:6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
