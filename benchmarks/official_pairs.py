"""vitrim next to the authors' forward on the same weights, timed in turns in one process (paired ratios).

    PYTHONPATH=src python benchmarks/official_pairs.py                      # every pair, batch 1 and 32
    PYTHONPATH=src python benchmarks/official_pairs.py --pairs tome --batch-sizes 1 --rounds 60 --json out.json

Pairs (random weights shared by both sides; eval, float32, ``torch.inference_mode``):

* ``tome``: DeiT-S + ToMe r = 13 against ``tests/reduce/tome_official.py``: the authors' timm patch with timm's
  modules (explicit softmax with the log-size bias, ``bipartite_soft_matching`` and ``merge_wavg`` as their
  ``merge.py``), with its default ``trace_source=False``, while vitrim keeps its default record of which patch went
  where (``trace_source=True``, for pictures and ``tokens_on_grid``);
* ``tome_untraced``: the same with vitrim's ``trace_source=False``: the same work on both sides;
* ``dynamicvit``: DynamicViT-S at ρ = 0.7 against ``tests/dynamicvit/dynamicvit_official_model.py``: their
  ``VisionTransformerDiffPruning`` evaluation forward with their modules (explicit softmax, argsort,
  ``batch_index_select``);
* ``dense``: DeiT-S against timm's eager ops on the same weights (``vitrim.bench.reference``);
* ``tome_functional``, ``dynamicvit_functional`` (not run by default): the same forwards written as plain functions of
  the state dict, with no module calls at all: a stricter baseline than the authors' code, whose per-call overhead
  is part of what an eager forward costs at batch 1.

The official repositories cannot be imported here (they patch or import timm), so their forwards are re-implemented
independently in the test folder, and checked against vitrim's logits before anything is timed. Method: after
``--warmup`` calls of each side, every round times one vitrim call and one official call, in alternating order (so
neither side always runs second); the ratio vitrim / official of each round is recorded, and the table gives the
median of those ratios (below 1 = vitrim faster), their interquartile range, and each side's median time. glibc's
allocator is pinned first (``vitrim.bench.allocator``), as every vitrim benchmark does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
for folder in ("tests/reduce", "tests/dynamicvit"):
    sys.path.insert(0, str(ROOT / folder))

import vitrim  # noqa: E402
from vitrim.bench.allocator import pin_malloc_threshold  # noqa: E402
from vitrim.bench.reference import timm_eager_forward  # noqa: E402

PAIRS = ("tome", "tome_untraced", "dynamicvit", "dense", "tome_functional", "dynamicvit_functional")
DEFAULT_PAIRS = ("tome", "tome_untraced", "dynamicvit", "dense")
Forward = Callable[[Tensor], Tensor]


def build_pair(name: str, seed: int = 0) -> tuple[Forward, Forward]:
    """(vitrim forward, official forward) on the same random weights."""
    torch.manual_seed(seed)
    if name in ("tome", "tome_untraced"):
        from tome_official import official_tome_model

        trace = name == "tome"  # the authors' default is trace_source=False; vitrim's keeps the record pictures need
        model = vitrim.create_model("deit_small_patch16_224", reducer="tome", r=13, trace_source=trace).eval()
        return model, official_tome_model(model.state_dict(), depth=12, heads=6, patch=16, r=13)
    if name == "dynamicvit":
        from dynamicvit_official_model import official_dynamicvit_model

        model = vitrim.create_model("dynamicvit_small_patch16_224", keep_ratio=0.7).eval()
        sd = model.state_dict()
        return model, official_dynamicvit_model(sd, depth=12, heads=6, patch=16, pruning_loc=(3, 6, 9), keep_ratio=0.7)
    if name == "tome_functional":
        from tome_functional import functional_tome_forward

        model = vitrim.create_model("deit_small_patch16_224", reducer="tome", r=13).eval()
        sd = model.state_dict()
        return model, lambda x: functional_tome_forward(sd, x, depth=12, heads=6, patch=16, r=13)
    if name == "dynamicvit_functional":
        from dynamicvit_reference import official_forward

        model = vitrim.create_model("dynamicvit_small_patch16_224", keep_ratio=0.7).eval()
        sd = model.state_dict()
        ratios = [0.7, 0.7**2, 0.7**3]
        return (
            model,
            lambda x: (
                official_forward(
                    sd, x, depth=12, heads=6, patch=16, pruning_loc=(3, 6, 9), token_ratio=ratios, training=False
                ).logits
            ),
        )
    if name == "dense":
        model = vitrim.create_model("deit_small_patch16_224").eval()
        return model, lambda x: timm_eager_forward(model, x)
    raise ValueError(f"unknown pair {name!r}; expected one of {PAIRS}")


def paired_ratios(ours: Forward, theirs: Forward, images: Tensor, rounds: int, warmup: int) -> dict[str, float]:
    """Median times and the median (and quartiles) of per-round time ratios ours / theirs."""
    t_ours, t_theirs, ratios = [], [], []
    with torch.inference_mode():
        for _ in range(warmup):
            ours(images)
            theirs(images)
        for i in range(rounds):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            took = [0.0, 0.0]
            for side in order:
                fn = ours if side == 0 else theirs
                start = time.perf_counter()
                fn(images)
                took[side] = time.perf_counter() - start
            t_ours.append(took[0])
            t_theirs.append(took[1])
            ratios.append(took[0] / took[1])
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "vitrim_ms": 1e3 * statistics.median(t_ours),
        "official_ms": 1e3 * statistics.median(t_theirs),
        "ratio": statistics.median(ratios),
        "ratio_q1": q1,
        "ratio_q3": q3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=",".join(DEFAULT_PAIRS), help=f"comma-separated, from {PAIRS}")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (0: 40 at batch 1, 10 above)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    pin_malloc_threshold()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results = []
    print(f"torch {torch.__version__}, {args.threads} threads, float32, eval; ratio = vitrim / official (median)")
    for name in args.pairs.split(","):
        ours, theirs = build_pair(name.strip())
        for batch in batches:
            images = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
            with torch.inference_mode():
                diff = (ours(images) - theirs(images)).abs().max().item()
            if diff > 1e-4:
                raise RuntimeError(f"{name}: vitrim and the official forward disagree by {diff:.3g} at batch {batch}")
            rounds = args.rounds or (40 if batch == 1 else 10)
            row = {"pair": name, "batch": batch, "rounds": rounds, "max_logit_diff": diff}
            row.update(paired_ratios(ours, theirs, images, rounds, args.warmup))
            results.append(row)
            print(
                f"{name:>10} batch {batch:>3}: vitrim {row['vitrim_ms']:.2f} ms, official {row['official_ms']:.2f} ms,"
                f" ratio {row['ratio']:.3f} (IQR {row['ratio_q1']:.3f}-{row['ratio_q3']:.3f}, {rounds} rounds,"
                f" logits within {diff:.1e})",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
