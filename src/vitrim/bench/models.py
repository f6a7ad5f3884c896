"""``vitrim bench models``: throughput, latency, FLOPs, parameters, memory and efficiency of models, in one run.

Every row is one model with one setting (dense, a DynamicViT keep ratio, a token reducer, or timm's eager ops on
the same weights): ``MODEL[key=value,...]`` gives one item its own setting; ``--keep-ratio`` and ``--reducer``
(repeatable) apply to the items without one, one row per value (see :mod:`vitrim.bench.model_cases`). All rows
are timed in turn within each repeat (row 1, row 2, …, the matrix products, then again), so that on a shared
machine every row sees the same load. What is measured:

* throughput: images/s at ``--batch-size``, float32, eval, ``torch.inference_mode``; the median of ``--repeats``
  timed batches after ``--warmup`` untimed ones;
* latency: batch 1, p50 and p95 of ``--latency-repeats`` timed calls;
* FLOPs per image: matrix products only, 2 per multiply-add, attention included (see :mod:`vitrim.bench.flops`),
  counted on the eager model at batch 1;
* efficiency: achieved GFLOP/s (FLOPs per image × images/s) over the GFLOP/s (median) of a dense float32 matrix
  product timed in the same turns: the model's own MLP product (B·N, D) @ (D, 4D) as ``F.linear`` runs it;
* speed-up: throughput over the first row's (the baseline), from the same turns;
* peak memory: the growth of the peak resident set (``VmHWM``) of a fresh process while it runs one batch, from
  after the model is built and a batch-1 forward has loaded torch's kernels; it excludes the weights (params × 4
  bytes) and so about one image's activations. ``peak_rss_mb`` is that process's whole peak.

``--device cuda`` runs every row and the reference product on a GPU (each timed call waits for the device; peak
memory is then ``torch.cuda.max_memory_allocated`` growth over one batch, in-process); ``--bf16`` runs them under
bfloat16 autocast (the reference product in bfloat16).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrim.bench.allocator import pin_malloc_threshold
from vitrim.bench.attention import _peak_rss_bytes
from vitrim.bench.flops import count_flops, model_flops_per_image
from vitrim.bench.model_cases import Case, build_cases, parse_reducer
from vitrim.bench.reference import check_timm_reference, timm_eager_forward
from vitrim.bench.timing import interleaved_samples, percentile
from vitrim.factory import create_model

# When a model has no ViT config to read: DeiT-S's MLP product, (B·197, 384) @ (384, 1536).
DEFAULT_MATMUL = (197, 384, 1536)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="throughput, latency, FLOPs, memory and efficiency of models (float32 or bf16, CPU or GPU)",
        description="Benchmark models; the first row is the baseline of the speed-up column.",
    )
    parser.add_argument(
        "models",
        help="comma-separated registered model names (see vitrim.list_models()), each optionally with its own "
        "settings: NAME[keep_ratio=R], NAME[reducer=tome:r=13], NAME[reducer='evit:keep_rate=0.7,layers=(3,6,9)'], "
        "NAME[depth=6] (create_model overrides)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="batch of the throughput measurement")
    parser.add_argument("--img-size", type=int, default=None, help="image side (default: each model's own)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=10, help="timed batches for throughput (median)")
    parser.add_argument("--latency-repeats", type=int, default=30, help="timed batch-1 calls (p50, p95); 0: skip")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    parser.add_argument(
        "--keep-ratio",
        type=float,
        action="append",
        default=None,
        help="DynamicViT keep ratio, passed as create_model(..., keep_ratio=R); repeat for several rows",
    )
    parser.add_argument(
        "--reducer",
        action="append",
        default=None,
        help="token reducer NAME[:key=value,...] (e.g. tome:r=13, evit:keep_rate=0.7, 'topk:keep_rate=(0.7,0.5)'); "
        "'none' = dense; repeat for several rows",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="create_model overrides for every model, e.g. embed_dim=32,depth=2",
    )
    parser.add_argument(
        "--timm-reference",
        action="store_true",
        help="after each dense ViT row, a row running timm's eager forward (written out) on the same weights",
    )
    parser.add_argument("--compile", action="store_true", help="time torch.compile(model) (FLOPs: the eager model)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (timings synchronise the device)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (weights stay float32)")
    parser.add_argument(
        "--memory", action=argparse.BooleanOptionalAction, default=True, help="measure peak memory (fresh process)"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.set_defaults(func=run)
    # Internal: measure one case's peak memory in this (fresh) process and print it as JSON.
    parser.add_argument("--_memory-case", dest="memory_case", default=None, help=argparse.SUPPRESS)


# -- building ---------------------------------------------------------------------------------------------------


def build_model(case: Case, img_size: int | None) -> nn.Module:
    """The case's model in eval mode, with its keep ratio or reducer applied; errors say which option failed."""
    kwargs = dict(case.overrides)
    if img_size is not None:
        kwargs["img_size"] = img_size
    if case.keep_ratio is not None:
        kwargs["keep_ratio"] = case.keep_ratio
    try:
        model = create_model(case.model, **kwargs)
    except (ValueError, TypeError) as err:
        if case.keep_ratio is not None and "keep_ratio" in str(err):
            raise ValueError(
                f"--keep-ratio {case.keep_ratio:g}: model {case.model!r} does not take keep_ratio "
                f"(DynamicViT models do, e.g. dynamicvit_small_patch16_224): {err}"
            ) from err
        raise
    if case.reducer is not None:
        model = _apply_reducer(model, case.reducer)
    if case.timm_reference:
        check_timm_reference(model)
    return model.eval()


def forward_fn(case: Case, model: nn.Module, compile: bool, bf16: bool = False) -> Callable[[Tensor], Tensor]:
    """What a row times: the model, or timm's eager ops on its weights; compiled with static shapes if asked.

    On an accelerator the call waits for the device (so that wall time is the work's time); with ``bf16`` it runs
    under bfloat16 autocast.
    """
    fn: Callable[[Tensor], Tensor] = model
    if case.timm_reference:
        fn = functools.partial(timm_eager_forward, check_timm_reference(model))
    if compile:
        fn = torch.compile(fn, dynamic=False)
    device = next(model.parameters()).device
    if not bf16 and device.type == "cpu":
        return fn
    return functools.partial(_on_device, fn, device, bf16)


def _on_device(fn: Callable[[Tensor], Tensor], device: torch.device, bf16: bool, images: Tensor) -> Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = fn(images)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def _apply_reducer(model: nn.Module, spec: str) -> nn.Module:
    import vitrim.reduce

    parsed = parse_reducer(spec)
    assert parsed is not None
    name, options = parsed
    try:
        result = vitrim.reduce.apply(model, name, **options)
    except (ValueError, TypeError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise ValueError(f"--reducer {spec!r}: {message}") from err
    return result if isinstance(result, nn.Module) else model


def _input_shape(model: nn.Module, img_size: int | None) -> tuple[int, int, int]:
    """(C, H, W) of the model's images: ``--img-size`` if given, else the model's own (224 without a config)."""
    config = getattr(model, "config", None)
    chans = int(getattr(config, "in_chans", 3))
    if img_size is not None:
        return chans, img_size, img_size
    size = getattr(config, "img_size", (224, 224))
    return chans, int(size[0]), int(size[1])


def _matmul_shape(model: nn.Module, hw: tuple[int, int], batch_size: int) -> tuple[int, int, int]:
    """(M, K, N) of the model's MLP product at this batch: M = B·tokens, K = D, N = hidden."""
    config = getattr(model, "config", None)
    try:
        p = int(config.patch_size)  # type: ignore[union-attr]
        tokens = int(config.num_prefix) + (hw[0] // p) * (hw[1] // p)  # type: ignore[union-attr]
        dim = int(config.embed_dim)  # type: ignore[union-attr]
        hidden = int(dim * config.mlp_ratio)  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        tokens, dim, hidden = DEFAULT_MATMUL
    return batch_size * tokens, dim, hidden


def _matmul(
    shape: tuple[int, int, int], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Callable[[], Tensor]:
    """An ``F.linear`` (M, K) @ (K, N)ᵀ + bias, as nn.Linear runs it, on fixed random inputs (waits for the device)."""
    M, K, N = shape
    g = torch.Generator().manual_seed(0)
    x, w, b = (
        t.to(device, dtype)
        for t in (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g))
    )
    if x.device.type != "cuda":
        return functools.partial(F.linear, x, w, b)

    def product() -> Tensor:
        out = F.linear(x, w, b)
        torch.cuda.synchronize(x.device)
        return out

    return product


# -- measuring --------------------------------------------------------------------------------------------------


@dataclass
class _Row:
    """What one row runs, prepared before any timing."""

    case: Case
    model: nn.Module
    runner: Callable[[Tensor], Tensor]
    images: Tensor  # (B, C, H, W)
    flops: float  # per image
    matmul_shape: tuple[int, int, int]


def _prepare(case: Case, model: nn.Module, args: argparse.Namespace) -> _Row:
    chans, h, w = _input_shape(model, args.img_size)
    flops = model_flops_per_image(model, (h, w), chans)
    if case.timm_reference:  # counted on the ops the row runs: a check that both do the same work
        one_image = torch.randn(1, chans, h, w).to(args.device)
        flops = count_flops(lambda: timm_eager_forward(check_timm_reference(model), one_image))
    images = torch.randn(args.batch_size, chans, h, w, generator=torch.Generator().manual_seed(0)).to(args.device)
    mm_shape = _matmul_shape(model, (h, w), args.batch_size)
    return _Row(case, model, forward_fn(case, model, args.compile, args.bf16), images, flops, mm_shape)


def measure_all(built: list[tuple[Case, nn.Module]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row of the table (see the module doc for what each number means).

    The rows, and one matrix product per distinct shape, are timed in turn within each repeat, so that on a
    shared machine the baseline, the other rows and the reference product all see the same load.
    """
    rows = [_prepare(case, model, args) for case, model in built]
    shapes = sorted({row.matmul_shape for row in rows})
    batch_fns = [functools.partial(row.runner, row.images) for row in rows]
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    products = [_matmul(shape, args.device, dtype) for shape in shapes]
    samples = interleaved_samples([*batch_fns, *products], args.repeats, args.warmup)
    times, mm_times = samples[: len(rows)], dict(zip(shapes, samples[len(rows) :]))
    latencies: list[list[float]] = [[] for _ in rows]
    if args.latency_repeats:
        one_fns = [functools.partial(row.runner, row.images[:1].clone()) for row in rows]
        latencies = interleaved_samples(one_fns, args.latency_repeats, args.warmup)
    results = []
    for row, batch_times, lat in zip(rows, times, latencies):
        h, w = row.images.shape[-2:]
        throughput = args.batch_size / statistics.median(batch_times)
        M, K, N = row.matmul_shape
        mm_gflops = 2 * M * K * N / statistics.median(mm_times[row.matmul_shape]) / 1e9
        achieved = row.flops * throughput / 1e9
        result: dict[str, Any] = {
            "setting": row.case.label,
            **asdict(row.case),
            "batch_size": args.batch_size,
            "img_size": [h, w],
            "threads": torch.get_num_threads(),
            "compile": bool(args.compile),
            "params_m": sum(p.numel() for p in row.model.parameters()) / 1e6,
            "gflops_per_image": row.flops / 1e9,
            "throughput_img_s": throughput,
            "batch_ms_median": statistics.median(batch_times) * 1e3,
            "latency_p50_ms": percentile(lat, 50) * 1e3 if lat else None,
            "latency_p95_ms": percentile(lat, 95) * 1e3 if lat else None,
            "achieved_gflop_s": achieved,
            "matmul_shape": list(row.matmul_shape),
            "matmul_gflop_s": mm_gflops,
            "efficiency": achieved / mm_gflops,
        }
        result["speedup"] = throughput / (args.batch_size / statistics.median(times[0]))
        if args.memory and torch.device(args.device).type == "cuda":
            result.update(_cuda_memory(row))
        elif args.memory:
            result.update(_measure_memory(row.case, args))
        results.append(result)
    return results


def _memory_here(args: argparse.Namespace) -> int:
    """In a fresh process: build, warm up at batch 1, then one batch; print the peak-RSS growth as JSON."""
    case = Case(**json.loads(args.memory_case))
    model = build_model(case, args.img_size)
    runner = forward_fn(case, model, args.compile)
    chans, h, w = _input_shape(model, args.img_size)
    images = torch.randn(args.batch_size, chans, h, w, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        runner(images[:1].clone())  # load kernels (and compile) before the baseline is read
        before = _peak_rss_bytes()
        runner(images)
        after = _peak_rss_bytes()
    print(json.dumps({"peak_mem_mb": (after - before) / 2**20, "peak_rss_mb": after / 2**20}))
    return 0


def _cuda_memory(row: _Row) -> dict[str, Any]:
    """Peak device memory of one batch above what was allocated before it (weights and inputs excluded)."""
    device = row.images.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        row.runner(row.images)
    peak = torch.cuda.max_memory_allocated(device)
    return {
        "peak_mem_mb": (peak - before) / 2**20,
        "memory_method": "torch.cuda.max_memory_allocated growth over one batch; weights and inputs excluded",
    }


def _measure_memory(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "vitrim.cli", "bench", "models", case.model]
    cmd += ["--_memory-case", json.dumps(asdict(case))]
    cmd += ["--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    if args.img_size is not None:
        cmd += ["--img-size", str(args.img_size)]
    if args.compile:
        cmd.append("--compile")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"memory measurement of {case.label!r} failed:\n{result.stderr.strip()}")
    values: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    values["memory_method"] = "peak RSS growth (VmHWM), fresh process, after a batch-1 warm-up; weights excluded"
    return values


# -- the command ------------------------------------------------------------------------------------------------


def _print_table(rows: list[dict[str, Any]]) -> None:
    width = max(len("model / setting"), *(len(r["setting"]) for r in rows))
    head = (
        f"{'model / setting':<{width}} {'GFLOPs':>7} {'params M':>8} {'img/s':>8} {'speed-up':>8} "
        f"{'p50 ms':>8} {'p95 ms':>8} {'GFLOP/s':>8} {'mm GFLOP/s':>10} {'eff':>5} {'peak MiB':>8}"
    )
    print(head)
    print("-" * len(head))

    def opt(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for r in rows:
        print(
            f"{r['setting']:<{width}} {r['gflops_per_image']:7.4g} {r['params_m']:8.2f} "
            f"{r['throughput_img_s']:8.1f} {r['speedup']:7.2f}x {opt(r['latency_p50_ms'], '8.1f')} "
            f"{opt(r['latency_p95_ms'], '8.1f')} {r['achieved_gflop_s']:8.1f} {r['matmul_gflop_s']:10.1f} "
            f"{r['efficiency']:5.2f} {opt(r.get('peak_mem_mb'), '8.1f')}"
        )


def run(args: argparse.Namespace) -> int:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.memory_case is not None:
        return _memory_here(args)
    cases = build_cases(args)
    pin_malloc_threshold()
    built: list[tuple[Case, nn.Module]] = []  # every option is checked before timing
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: torch sees no CUDA device here")
    for case in cases:
        try:
            built.append((case, build_model(case, args.img_size).to(device)))
        except ValueError as err:
            if not case.timm_reference:
                raise
            print(f"(no timm reference row for {case.model}: {err})")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(
        f"models, {'bfloat16 autocast' if args.bf16 else 'float32'}, eval, inference_mode, batch {args.batch_size}, "
        f"{where}, torch {torch.__version__}{', torch.compile' if args.compile else ''}"
    )
    rows = measure_all(built, args)
    _print_table(rows)
    print(
        "img/s: median of repeats; p50/p95: batch-1 latency; eff: achieved GFLOP/s over the dense matmul "
        "GFLOP/s (mm) timed in the same turns; peak MiB: peak-RSS growth of one batch (fresh process)"
    )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "memory_case")}
        with open(args.json, "w") as f:
            json.dump({"config": config | {"threads": torch.get_num_threads()}, "rows": rows}, f, indent=2)
    return 0
