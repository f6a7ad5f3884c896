"""torch.compile against eager for every model kind, same weights, timed in turns (paired ratios).

    PYTHONPATH=src python benchmarks/compile_vs_eager.py --batch-sizes 1,32 --threads 2

Kinds: DeiT-S dense, DeiT-S + ToMe r = 13, + EViT 0.7, + top-k 0.7, DynamicViT-S ρ = 0.7 (eval). Each is compiled
with inductor, ``fullgraph=True`` (any graph break fails) and static shapes, once per batch size; the first call's
time is the compile time. Then eager and compiled calls alternate; the table gives each side's median time and
the median of the per-round ratios compiled / eager (below 1: compiled faster), and the largest logit difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import vitrim
from vitrim.bench.allocator import pin_malloc_threshold

KINDS = {
    "dense": lambda: vitrim.create_model("deit_small_patch16_224"),
    "tome": lambda: vitrim.create_model("deit_small_patch16_224", reducer="tome", r=13),
    "evit": lambda: vitrim.create_model("deit_small_patch16_224", reducer="evit", keep_rate=0.7),
    "topk": lambda: vitrim.create_model("deit_small_patch16_224", reducer="topk", keep_rate=0.7),
    "dynamicvit": lambda: vitrim.create_model("dynamicvit_small_patch16_224", keep_ratio=0.7),
}


def measure(model: nn.Module, batch: int, rounds: int) -> dict[str, float]:
    images = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        start = time.perf_counter()
        got = compiled(images)
        compile_s = time.perf_counter() - start
        diff = float((got - model(images)).abs().max())
        eager_t, compiled_t, ratios = [], [], []
        for _ in range(2):
            model(images)
            compiled(images)
        for i in range(rounds):
            took = {}
            for name, fn in (
                (("eager", model), ("compiled", compiled))
                if i % 2 == 0
                else (
                    ("compiled", compiled),
                    ("eager", model),
                )
            ):
                start = time.perf_counter()
                fn(images)
                took[name] = time.perf_counter() - start
            eager_t.append(took["eager"])
            compiled_t.append(took["compiled"])
            ratios.append(took["compiled"] / took["eager"])
    return {
        "compile_s": compile_s,
        "max_diff": diff,
        "eager_ms": 1e3 * statistics.median(eager_t),
        "compiled_ms": 1e3 * statistics.median(compiled_t),
        "ratio": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=0, help="0: 30 at batch 1, 6 above")
    args = parser.parse_args()
    pin_malloc_threshold()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, float32, eval; ratio = compiled / eager (median)")
    for kind in args.kinds.split(","):
        torch.manual_seed(0)
        model = KINDS[kind]().eval()
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            r = measure(model, batch, args.rounds or (30 if batch == 1 else 6))
            print(
                f"{kind:>10} batch {batch:>3}: eager {r['eager_ms']:.1f} ms, compiled {r['compiled_ms']:.1f} ms, "
                f"ratio {r['ratio']:.3f}, compile {r['compile_s']:.0f} s, max |Δ logit| {r['max_diff']:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
