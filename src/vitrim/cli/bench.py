"""``vitrim bench attention|models|reducers``: the benchmarks, with their options and printed tables."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from vitrim.bench import attention, models, reducers, reducers_report
from vitrim.bench.allocator import pin_malloc_threshold
from vitrim.bench.model_cases import Case, build_cases
from vitrim.cli.bench_ops import register_ops
from vitrim.cli.bench_vlm import register_vlm
from vitrim.cli.common import (
    BATCH,
    IMAGE_SIDE,
    TIMED,
    UNTIMED,
    Bounded,
    add_threads_argument,
    check_output_folder,
    parse_ints,
    parse_model_set,
)
from vitrim.devices import parse_device
from vitrim.extras import require
from vitrim.models.config_limits import LIMITS

SET_FORM = "KEY=VALUE[,KEY=VALUE]"  # bench models --set (errors show it as --help does)
MEMORY_LENGTH = Bounded(int, 0, LIMITS["num_patches"], "a sequence length, at most the tokens of a model's image")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark attention backends, models, reducers, host calls")
    kinds = parser.add_subparsers(dest="bench_kind", required=True, metavar="KIND")

    p = kinds.add_parser("attention", help="auto vs math vs torch SDPA, float32, this machine")
    p.add_argument("--batch", type=BATCH, default=8)
    p.add_argument("--heads", type=Bounded(int, 1, LIMITS["num_heads"], "attention heads"), default=6)
    p.add_argument("--head-dim", type=Bounded(int, 1, 1024, "channels per head"), default=64)
    p.add_argument("--lengths", default="197,1024,4096", help="comma-separated sequence lengths N")
    p.add_argument("--repeats", type=UNTIMED, default=0, help="timed repeats per case (0: chosen per N)")
    add_threads_argument(p)
    p.add_argument(
        "--memory-length", type=MEMORY_LENGTH, default=4096, help="N at which peak memory is measured (0: skip)"
    )
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=run_attention)

    s = models.BenchSettings()
    p = kinds.add_parser(
        "models",
        help="throughput, latency, FLOPs, memory and efficiency of models (float32 or bf16, CPU or GPU)",
        description="Benchmark models; the first row is the baseline of the speed-up column.",
    )
    p.add_argument(
        "models",
        help="comma-separated registered model names (see vitrim.list_models(); timm's NAME.TAG[pretrained=True] for "
        "its weights) or hub repos (hf-hub:ORG/NAME), each optionally with its own settings: NAME[keep_ratio=R], "
        "NAME[reducer=tome:r=13], NAME[reducer='evit:keep_rate=0.7,layers=(3,6,9)'], NAME[depth=6] (create_model "
        "overrides)",
    )
    p.add_argument("--batch-size", type=BATCH, default=s.batch_size, help="batch of the throughput measurement")
    p.add_argument("--img-size", type=IMAGE_SIDE, default=s.img_size, help="image side (default: each model's own)")
    add_threads_argument(p)
    p.add_argument("--repeats", type=TIMED, default=s.repeats, help="timed batches for throughput (median)")
    p.add_argument("--latency-repeats", type=UNTIMED, default=s.latency_repeats, help="timed batch-1 calls; 0: skip")
    p.add_argument("--warmup", type=UNTIMED, default=s.warmup, help="untimed calls before timing")
    p.add_argument(
        "--keep-ratio",
        type=Bounded(float, 0.0, 1.0, "the share of tokens DynamicViT keeps", low_open=True),
        action="append",
        default=None,
        help="DynamicViT keep ratio, passed as create_model(..., keep_ratio=R); repeat for several rows",
    )
    p.add_argument(
        "--reducer",
        action="append",
        default=None,
        help="token reducer NAME[:key=value,...] (e.g. tome:r=13, evit:keep_rate=0.7, 'topk:keep_rate=(0.7,0.5)'); "
        "'none' = dense; repeat for several rows",
    )
    _add_set_argument(p)
    p.add_argument(
        "--timm-reference",
        action="store_true",
        help="after each dense ViT row, a row running timm's eager forward (written out) on the same weights",
    )
    p.add_argument("--compile", action="store_true", help="time torch.compile(model) (FLOPs: the eager model)")
    p.add_argument(
        "--optimize",
        action="store_true",
        help="time vitrim.optimize(model, batch_size=...): fullgraph, static shapes, CUDA graphs on a GPU",
    )
    p.add_argument("--device", default=s.device, help="cpu, cuda or cuda:N (timings wait for the device)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (weights stay float32)")
    p.add_argument(
        "--memory", action=argparse.BooleanOptionalAction, default=s.memory, help="measure peak memory (fresh process)"
    )
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.set_defaults(func=run_models)
    register_reducers(kinds)
    register_ops(kinds)
    register_vlm(kinds)


def _add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE[,KEY=VALUE]``, repeatable: create_model overrides for every benchmarked model."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        metavar=SET_FORM,
        help="create_model overrides for every model, e.g. embed_dim=32,depth=2",
    )


def register_reducers(kinds: argparse._SubParsersAction) -> None:
    s = reducers.ReducerBenchSettings()
    p = kinds.add_parser(
        "reducers",
        help="every registered token reducer at matched GMACs: speed against dense, and accuracy off the shelf",
        description="Tune every registered reducer that declares a strength option to each compute target (by "
        "counting FLOPs, no timing), then time all of them against dense in turns (paired, median). GMACs count "
        "multiply-adds: the papers' 'GFLOPs' (DeiT-S/16 at 224: 4.6).",
    )
    p.add_argument(
        "--models",
        "--model",
        dest="models",
        default="deit_small_patch16_224",
        help="comma-separated registered model names (random weights: speed and FLOPs do not depend on them)",
    )
    p.add_argument(
        "--targets",
        default=",".join(t.label for t in s.targets),
        help="comma-separated compute targets in GMACs (the papers' GFLOPs), or percentages of each model's dense "
        "count (63%%)",
    )
    p.add_argument("--batch-sizes", default=",".join(map(str, s.batch_sizes)), help="comma-separated batch sizes")
    p.add_argument(
        "--repeats",
        default=",".join(map(str, s.repeats)),
        help="timed calls per row (median): one count, or one per batch size (10,5)",
    )
    p.add_argument("--warmup", type=UNTIMED, default=s.warmup, help="untimed calls per row and batch size")
    p.add_argument("--img-size", type=IMAGE_SIDE, default=None, help="image side (default: each model's own)")
    _add_set_argument(p)
    p.add_argument(
        "--optimize",
        action="store_true",
        help="time every row (dense too) through vitrim.optimize, one compiled graph per batch size",
    )
    p.add_argument(
        "--accuracy-model",
        default=None,
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a trained classifier (e.g. runs/demo/dense from vitrim demo): top-1 off the shelf of each reducer at "
        "the same fraction of its dense GMACs, on its run's held-out split",
    )
    add_threads_argument(p)
    p.add_argument("--out", default=None, help="write results.json and the pictures to this folder")
    p.set_defaults(func=run_reducers)


def run_attention(args: argparse.Namespace) -> int:
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if not lengths or not all(MEMORY_LENGTH.contains(n) and n > 0 for n in lengths):
        raise ValueError(f"--lengths must be sequence lengths in [1, {MEMORY_LENGTH.high:g}], got {args.lengths!r}")
    pin_malloc_threshold()
    shape = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim)
    print(f"attention, float32, B={args.batch}, H={args.heads}, d={args.head_dim}, {torch.get_num_threads()} threads")
    print("median ms (ratio to torch SDPA)")
    print(f"{'N':>6} " + " ".join(f"{name:>24}" for name in attention.CASES))
    config = {key: value for key, value in vars(args).items() if key != "func"}
    results: dict[str, dict] = {"config": config | {"threads": torch.get_num_threads()}, "times_ms": {}}
    for length in lengths:
        times = attention.time_cases(length=length, repeats=args.repeats, **shape)
        base = times["torch_sdpa"]
        results["times_ms"][length] = {name: t * 1e3 for name, t in times.items()}
        print(f"{length:>6} " + " ".join(f"{t * 1e3:>14.2f} ({t / base:5.2f}x)" for t in times.values()))
    if args.memory_length > 0:
        print(f"peak memory growth at N={args.memory_length} (fresh process per case):")
        results["peak_memory_mb"] = {}
        for name in attention.CASES:
            mb = attention.memory_mb(name, length=args.memory_length, **shape)
            results["peak_memory_mb"][name] = mb
            print(f"  {name:>24}: {mb:9.1f} MiB")
        n = args.memory_length
        matrix_mb = args.batch * args.heads * n * n * 4 / 2**20
        print(f"  (one float32 N x N attention matrix for all heads: {matrix_mb:.1f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def run_models(args: argparse.Namespace) -> int:
    if (args.compile or args.optimize) and args.warmup == 0:
        raise ValueError(f"--{'compile' if args.compile else 'optimize'} needs --warmup >= 1 (the first call compiles)")
    if args.compile and args.optimize:
        raise ValueError("pass --compile or --optimize, not both")
    cases = build_cases(
        args.models,
        overrides=parse_model_set(args.overrides, "--set", SET_FORM),
        keep_ratios=args.keep_ratio or (),
        reducers=args.reducer or (),
        img_size=args.img_size,
        timm_reference=args.timm_reference,
    )
    settings = models.BenchSettings(
        batch_size=args.batch_size,
        img_size=args.img_size,
        repeats=args.repeats,
        latency_repeats=args.latency_repeats,
        warmup=args.warmup,
        compile=args.compile,
        optimize=args.optimize,
        memory=args.memory,
        device=args.device,
        bf16=args.bf16,
    )
    device = parse_device(args.device, "--device")
    pin_malloc_threshold()
    built: list[tuple[Case, nn.Module]] = []  # every option is checked before timing
    for case in cases:
        try:
            built.append((case, models.build_model(case, args.img_size).to(device)))
        except ValueError as err:
            if not case.timm_reference:
                raise
            print(f"(no timm reference row for {case.model}: {err})")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(
        f"models, {'bfloat16 autocast' if args.bf16 else 'float32'}, eval, inference_mode, batch {args.batch_size}, "
        f"{where}, torch {torch.__version__}{', torch.compile' if args.compile else ''}"
        f"{', vitrim.optimize' if args.optimize else ''}"
    )
    rows = models.measure_all(built, settings)
    models.print_table(rows)
    print(
        "img/s: median of repeats; p50/p95: batch-1 latency; eff: achieved GFLOP/s over the dense matmul "
        "GFLOP/s (mm) timed in the same turns; peak MiB: peak-RSS growth of one batch (fresh process)"
    )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        with open(args.json, "w") as f:
            json.dump({"config": config | {"threads": torch.get_num_threads()}, "rows": rows}, f, indent=2)
    return 0


def _positive_ints(text: str, option: str, bound: Bounded) -> tuple[int, ...]:
    return parse_ints(text, option, bound)


def run_reducers(args: argparse.Namespace) -> int:
    settings = reducers.ReducerBenchSettings(
        targets=reducers.parse_targets(args.targets),
        batch_sizes=_positive_ints(args.batch_sizes, "--batch-sizes", BATCH),
        repeats=_positive_ints(args.repeats, "--repeats", TIMED),
        warmup=args.warmup,
        img_size=args.img_size,
        overrides=parse_model_set(args.overrides, "--set", SET_FORM),
        optimize=args.optimize,
    )
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    out = None if args.out is None else check_output_folder(args.out, "--out")
    if out is not None:
        require("matplotlib", feature="the pictures of bench reducers --out")  # before the benchmark, not after
    accuracy = None if args.accuracy_model is None else reducers.AccuracyModel(args.accuracy_model)
    pin_malloc_threshold()
    results = reducers.bench_reducers(names, settings, accuracy)
    results["config"] = {k: v for k, v in vars(args).items() if k != "func"} | {"threads": torch.get_num_threads()}
    print(
        f"reducers at matched GMACs: float32, eval, inference_mode, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; repeats {'/'.join(map(str, settings.repeats_per_batch))} at batch "
        f"{'/'.join(map(str, settings.batch_sizes))}, rows timed in turns; speed-up = median over repeats of dense "
        "time / row time"
    )
    print()
    print(reducers_report.markdown(results), end="")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        reducers_report.plot_speedup(results, out / "gmacs_vs_speedup.png")
        written = ["results.json", "gmacs_vs_speedup.png"]
        if accuracy is not None:
            reducers_report.plot_accuracy(results, out / "accuracy_vs_gmacs.png")
            written.append("accuracy_vs_gmacs.png")
        print(f"\nwrote {', '.join(str(Path(out) / w) for w in written)}")
    return 0
