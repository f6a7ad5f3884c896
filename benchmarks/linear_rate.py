"""How close a ViT-S linear layer at batch 1 runs to this CPU's limit: F.linear against MKL's prepacked weights.

    PYTHONPATH=src python benchmarks/linear_rate.py --threads 2 --repeats 200

The four linear shapes of a ViT-S/16 block at 224, batch 1 (197 tokens): qkv, fc1, fc2, proj. For each, F.linear
(the addmm every ViT here runs) and ``torch.ops.mkl._mkl_linear`` with weights prepacked for this batch (what
Inductor uses on CPU) are called in turns; the table gives each one's median time, F.linear's GFLOP/s and the median
of the per-round ratios packed / F.linear (below 1: packing is faster). The outputs are compared first.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from vitrim.bench.timing import interleaved_samples

SHAPES = {"qkv": (384, 1152), "fc1": (384, 1536), "fc2": (1536, 384), "proj": (384, 384)}  # (in, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=197)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    m = args.tokens
    print(f"| layer (M = {m}) | F.linear µs | GFLOP/s | packed µs | packed / F.linear |")
    print("|---|---:|---:|---:|---:|")
    for name, (k, n) in SHAPES.items():
        x, w, b = torch.randn(1, m, k), torch.randn(n, k), torch.randn(n)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        torch.testing.assert_close(
            torch.ops.mkl._mkl_linear(x, packed, w, b, m), F.linear(x, w, b), rtol=1e-4, atol=1e-3
        )
        calls = [
            lambda x=x, w=w, b=b: F.linear(x, w, b),
            lambda x=x, w=w, b=b, packed=packed: torch.ops.mkl._mkl_linear(x, packed, w, b, m),
        ]
        plain, fast = interleaved_samples(calls, args.repeats)
        ratio = statistics.median(p / q for q, p in zip(plain, fast))
        t_plain, t_fast = statistics.median(plain), statistics.median(fast)
        rate = 2 * m * k * n / t_plain / 1e9
        print(f"| {name} {k}→{n} | {t_plain * 1e6:.0f} | {rate:.0f} | {t_fast * 1e6:.0f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
