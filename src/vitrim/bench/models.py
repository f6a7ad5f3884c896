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
  counted on the eager model at batch 2 (:func:`vitrim.bench.flops.model_flops_per_image`);
* efficiency: achieved GFLOP/s (FLOPs per image × images/s) over the GFLOP/s (median) of a dense float32 matrix
  product timed in the same turns: the model's own MLP product (B·N, D) @ (D, 4D) as ``F.linear`` runs it;
* speed-up: throughput over the first row's (the baseline), from the same turns;
* peak memory: the growth of the peak resident set (``VmHWM``) of a fresh process while it runs one batch, from
  after the model is built and a batch-1 forward has loaded torch's kernels; it excludes the weights (params × 4
  bytes) and so about one image's activations. ``peak_rss_mb`` is that process's whole peak.

With ``device="cuda"`` every row and the reference product run on a GPU (each timed call waits for the device; peak
memory is then the growth of ``torch.cuda.max_memory_allocated`` over one batch, in-process); with ``bf16`` they run
under bfloat16 autocast (the reference product in bfloat16).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrim import reduce
from vitrim.bench.flops import count_flops, model_flops_per_image
from vitrim.bench.memory import measure_in_fresh_process, peak_rss_bytes
from vitrim.bench.model_cases import Case, parse_reducer
from vitrim.bench.reference import check_timm_reference, timm_eager_forward
from vitrim.bench.timing import interleaved_samples, percentile
from vitrim.factory import create_model
from vitrim.optimize import optimize

# When a model has no ViT config to read: DeiT-S's MLP product, (B·197, 384) @ (384, 1536).
DEFAULT_MATMUL = (197, 384, 1536)


@dataclass(frozen=True)
class BenchSettings:
    """How ``measure_all`` measures (``vitrim bench models`` fills it from its options)."""

    batch_size: int = 32  # batch of the throughput measurement
    img_size: int | None = None  # image side; None: each model's own
    repeats: int = 10  # timed batches for throughput (median)
    latency_repeats: int = 30  # timed batch-1 calls (p50, p95); 0: skip
    warmup: int = 3  # untimed calls before timing
    compile: bool = False  # time torch.compile(model); FLOPs are counted on the eager model
    optimize: bool = False  # time vitrim.optimize(model, batch_size=...) (CUDA graphs on a GPU), one per batch size
    memory: bool = True  # peak memory of one batch, in a fresh process (in-process on a GPU)
    device: str = "cpu"  # cpu, cuda or cuda:N; the models must already be there
    bf16: bool = False  # bfloat16 autocast (weights stay float32)


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


def forward_fn(
    case: Case, model: nn.Module, compile: bool, bf16: bool = False, optimize_for: tuple[int, ...] | None = None
) -> Callable[[Tensor], Tensor]:
    """What a row times: the model, or timm's eager ops on its weights; compiled with static shapes if asked, or
    (``optimize_for``: the input shape) through :func:`vitrim.optimize` (timm's rows: ``torch.compile``).

    On an accelerator the call waits for the device (so that wall time is the work's time); with ``bf16`` it runs
    under bfloat16 autocast.
    """
    fn: Callable[[Tensor], Tensor] = model
    device = next(model.parameters()).device
    if optimize_for is not None and not case.timm_reference:
        batch, _, h, w = optimize_for
        dtype = torch.bfloat16 if bf16 else None
        fast = optimize(model, batch_size=batch, device=device, dtype=dtype, img_size=(h, w))
        return fast if device.type == "cpu" else functools.partial(_on_device, fast, device, False)
    compile = compile or optimize_for is not None
    if case.timm_reference:
        fn = functools.partial(timm_eager_forward, check_timm_reference(model))
    if compile:
        fn = torch.compile(fn, dynamic=False)
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
    parsed = parse_reducer(spec)
    assert parsed is not None
    name, options = parsed
    try:
        result = reduce.apply(model, name, **options)
    except (ValueError, TypeError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise ValueError(f"--reducer {spec!r}: {message}") from err
    return result if isinstance(result, nn.Module) else model


def input_shape(model: nn.Module, img_size: int | None) -> tuple[int, int, int]:
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
    runner_one: Callable[[Tensor], Tensor]  # at batch 1 (latency): the same, or its own optimised graph
    images: Tensor  # (B, C, H, W)
    flops: float  # per image
    matmul_shape: tuple[int, int, int]


def _prepare(case: Case, model: nn.Module, args: BenchSettings) -> _Row:
    chans, h, w = input_shape(model, args.img_size)
    flops = model_flops_per_image(model, (h, w), chans)
    if case.timm_reference:  # counted on the ops the row runs: a check that both do the same work
        one_image = torch.randn(1, chans, h, w, device=args.device)
        flops = count_flops(lambda: timm_eager_forward(check_timm_reference(model), one_image))
    images = torch.randn(args.batch_size, chans, h, w, generator=torch.Generator().manual_seed(0)).to(args.device)
    mm_shape = _matmul_shape(model, (h, w), args.batch_size)
    runner = forward_fn(case, model, args.compile, args.bf16, tuple(images.shape) if args.optimize else None)
    runner_one = runner
    if args.optimize and args.batch_size != 1 and args.latency_repeats:
        runner_one = forward_fn(case, model, args.compile, args.bf16, (1, *images.shape[1:]))
    return _Row(case, model, runner, runner_one, images, flops, mm_shape)


def measure_all(built: list[tuple[Case, nn.Module]], args: BenchSettings) -> list[dict[str, Any]]:
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
        one_fns = [functools.partial(row.runner_one, row.images[:1].clone()) for row in rows]
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
            "optimize": bool(args.optimize),
            "device": str(row.images.device),
            "bf16": bool(args.bf16),
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
        if args.memory and row.images.device.type == "cuda":
            result.update(_cuda_memory(row))
        elif args.memory:
            result.update(_measure_memory(row.case, args))
        results.append(result)
    return results


def batch_memory(case: dict[str, Any], batch_size: int, img_size: int | None, compile: bool) -> dict[str, float]:
    """Build, warm up at batch 1, then run one batch: the peak-RSS growth (call it through a fresh process)."""
    row = Case(**case)
    model = build_model(row, img_size)
    runner = forward_fn(row, model, compile)
    chans, h, w = input_shape(model, img_size)
    images = torch.randn(batch_size, chans, h, w, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        runner(images[:1].clone())  # load kernels (and compile) before the baseline is read
        before = peak_rss_bytes()
        runner(images)
        after = peak_rss_bytes()
    return {"peak_mem_mb": (after - before) / 2**20, "peak_rss_mb": after / 2**20}


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


def _measure_memory(case: Case, args: BenchSettings) -> dict[str, Any]:
    values = measure_in_fresh_process(
        batch_memory,
        case=asdict(case),
        batch_size=args.batch_size,
        img_size=args.img_size,
        compile=args.compile or args.optimize,
    )
    values["memory_method"] = "peak RSS growth (VmHWM), fresh process, after a batch-1 warm-up; weights excluded"
    return values


# -- the table ---------------------------------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as the command prints them."""
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
