"""Token reduction on the GPU: every reducer against dense, eager and graph-captured, batch 1 and 256, bf16; the
authors' own ToMe and DynamicViT beside vitrim's; a per-op CUDA profile. One command fills issue 27's table:

    PYTHONPATH=src python benchmarks/gpu_models.py --out docs/gpu            # one H100/H200, about 8 minutes
    PYTHONPATH=src python benchmarks/gpu_models.py --device cpu --small --out /tmp/smoke   # the smoke test's run

Rows, for each backbone (ViT-B/16 with dense and every registered reducer at its papers' setting, as ``vitrim bench
ops``; DINOv2-S/14-reg4 and SigLIP-B/16 at 224 with dense, ToMe r = 13 and DynamicViT 0.7):

* eager: the model as it is, bf16 autocast, batch 1 (ms) and 256 (img/s);
* graph: ``vitrim.optimize(model, batch_size=B, dtype=torch.bfloat16)`` on both sides (CUDA graphs by
  "reduce-overhead"; at batch 256 the same compiled path), batch 1 and 256;
* the authors' code on the same weights (ViT-B only): ToMe's timm patch (``tests/reduce/tome_official.py``) and
  DynamicViT's model (``tests/dynamicvit/dynamicvit_official_model.py``), eager and ``torch.compile``-d, beside
  vitrim's eager and optimised rows;
* profiles: the 15 operators with the most device time in one eager forward of dense, ToMe and DynamicViT, batch 1
  and 256 (self time; CPU time where there is no GPU).

Timing: each call waits for the device (CUDA events on a GPU), the rows of a table are called in turns within each
repeat (every row sees the same clocks), median of the repeats after warm-up. Speed-ups: eager rows over eager dense,
graph rows over graph dense, the authors' rows over vitrim's same-mode row. GFLOPs per image: vitrim's counter
(matrix products, 2 per multiply-add). Compiling takes most of the time: the rows are run cheapest first, and a row
that would start after ``--budget-min`` minutes is skipped and listed (rerun with a larger budget; Inductor's cache
makes a second run faster). Writes ``gpu_models.json`` and ``gpu_models.md`` (the table, with issue 27's targets).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
for folder in ("tests/reduce", "tests/dynamicvit"):
    sys.path.insert(0, str(ROOT / folder))

import vitrim  # noqa: E402
from vitrim.bench.flops import model_flops_per_image  # noqa: E402
from vitrim.bench.ops import DEFAULT_SETTINGS  # noqa: E402
from vitrim.reduce import get_reducer, list_reducers, parse_spec  # noqa: E402

BACKBONES = {  # table -> (model, overrides, reducers beyond dense: None = every registered reducer)
    "ViT-B/16 @224": ("vit_base_patch16_224", {}, None),
    "DINOv2-S/14-reg4 @224": ("vit_small_patch14_reg4_dinov2", {"img_size": 224}, ("tome", "dynamicvit")),
    "SigLIP-B/16 @224": ("vit_base_patch16_siglip_224", {}, ("tome", "dynamicvit")),
}
SMALL = {"embed_dim": 32, "depth": 4, "num_heads": 2, "img_size": 32, "patch_size": 8}
# issue 27, item 3: (batch, mode) -> minimum speed-up over dense for a reducer (None: every reducer, "flop": 0.85 of
# its FLOP ratio)
TARGETS = {"tome": {(1, "graph"): 1.2, (256, "graph"): 1.5, (256, "eager"): 1.3},
           "topk": {(1, "graph"): 1.2, (256, "graph"): 1.4},
           "evit": {(256, "graph"): 1.4},
           "dynamicvit": {(256, "graph"): 1.4, (256, "eager"): 1.4},
           "mctf": {(256, "graph"): 1.0}}  # fmt: skip


class Clock:
    """Wall time of one call that waits for the device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[Tensor], Tensor], x: Tensor) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn(x)
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn(x)
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3


class Run:
    """Settings, the clock, the elapsed-time budget, and what was skipped."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        self.small = args.small
        self.batches = (1, 2) if args.small else (1, 256)
        self.repeats = {1: 2, 2: 1} if args.small else {1: 50, 256: 10}
        self.warmup = 1 if args.small else 5
        self.backend = "eager" if args.small else "inductor"  # the smoke run traces, it does not build kernels
        self.dtype = None if self.device.type == "cpu" else torch.bfloat16
        self.budget_s = 60 * args.budget_min
        self.start = time.perf_counter()
        self.clock = Clock(self.device)
        self.skipped: list[str] = []

    def time_left(self, what: str) -> bool:
        if time.perf_counter() - self.start < self.budget_s:
            return True
        self.skipped.append(what)
        print(f"skipped (time budget): {what}", flush=True)
        return False

    def images(self, batch: int, hw: tuple[int, int]) -> Tensor:
        return torch.randn(batch, 3, *hw, generator=torch.Generator().manual_seed(batch)).to(self.device)

    def eager(self, model: nn.Module) -> Callable[[Tensor], Tensor]:
        def call(x: Tensor) -> Tensor:
            with torch.inference_mode(), torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None):
                return model(x)

        return call

    def optimized(self, model: nn.Module, batch: int) -> Callable[[Tensor], Tensor]:
        return vitrim.optimize(model, batch_size=batch, device=self.device, dtype=self.dtype, backend=self.backend)

    def compiled(self, model: nn.Module, batch: int) -> Callable[[Tensor], Tensor]:
        """The authors' model through ``torch.compile``, CUDA graphs at batch 1 as vitrim's (not fullgraph: their
        code is not ours to rid of graph breaks)."""
        if self.device.type == "cuda" and batch == 1:
            return self.eager(torch.compile(model, dynamic=False, mode="reduce-overhead"))  # type: ignore[arg-type]
        return self.eager(torch.compile(model, dynamic=False, backend=self.backend))  # type: ignore[arg-type]

    def measure(self, fns: dict[str, Callable[[Tensor], Tensor]], x: Tensor) -> dict[str, float]:
        """Median seconds per call of each function on ``x``, called in turns (see module doc)."""
        batch = x.shape[0]
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(self.warmup):
            for fn in fns.values():
                fn(x)
        for _ in range(self.repeats[batch]):
            for name, fn in fns.items():
                samples[name].append(self.clock(fn, x))
        return {name: statistics.median(s) for name, s in samples.items()}


def reducer_specs(names: tuple[str, ...] | None, small: bool) -> dict[str, tuple[str, dict[str, Any]] | None]:
    """Row label -> (reducer, options) (None: dense). Small: each reducer's own test options (4 blocks, 16 patches)."""
    chosen = list_reducers() if names is None else [n for n in names if n in list_reducers()]
    rows: dict[str, tuple[str, dict[str, Any]] | None] = {"dense": None}
    for name in chosen:
        if small:
            rows[name] = (name, dict(get_reducer(name).example_options))
        else:
            rows[DEFAULT_SETTINGS[name]] = parse_spec(DEFAULT_SETTINGS[name])
    return rows


def build(model_name: str, overrides: dict[str, Any], spec: tuple[str, dict[str, Any]] | None) -> nn.Module:
    torch.manual_seed(0)
    options = {} if spec is None else {"reducer": spec[0], **spec[1]}
    return vitrim.create_model(model_name, **overrides, **options).eval()


def backbone_table(run: Run, model_name: str, overrides: dict[str, Any], names: tuple[str, ...] | None) -> dict:
    specs = reducer_specs(names, run.small)
    models = {label: build(model_name, overrides, spec) for label, spec in specs.items()}
    hw = tuple(models["dense"].config.img_size)
    rows: dict[str, dict[str, Any]] = {label: {} for label in models}
    dense_flops = model_flops_per_image(models["dense"], hw)
    for label, model in models.items():
        rows[label]["reducer"] = None if specs[label] is None else specs[label][0]
        rows[label]["gflops"] = model_flops_per_image(model, hw) / 1e9
        rows[label]["flop_ratio"] = dense_flops / (rows[label]["gflops"] * 1e9)
        model.to(run.device)
    for batch in run.batches:
        x = run.images(batch, hw)  # type: ignore[arg-type]
        eager = run.measure({label: run.eager(m) for label, m in models.items()}, x)
        for label in models:
            rows[label][f"eager_{batch}"] = _speed(eager[label], eager["dense"], batch)
        print(f"  eager, batch {batch}: done", flush=True)
    for batch in run.batches:
        if not run.time_left(f"{model_name}: vitrim.optimize at batch {batch}"):
            continue
        x = run.images(batch, hw)  # type: ignore[arg-type]
        graphs = {label: run.optimized(m, batch) for label, m in models.items()}
        timed = run.measure(graphs, x)  # the warm-up calls compile and record
        for label in models:
            rows[label][f"graph_{batch}"] = _speed(timed[label], timed["dense"], batch)
        print(f"  vitrim.optimize, batch {batch}: done", flush=True)
        del graphs
        torch._dynamo.reset()
    return {"img_size": list(hw), "rows": rows, "models": models}


def _speed(seconds: float, dense_seconds: float, batch: int) -> dict[str, float]:
    return {"ms": 1e3 * seconds, "img_s": batch / seconds, "speedup": dense_seconds / seconds}


def authors_table(run: Run, vit: dict[str, Any]) -> dict[str, Any]:
    """vitrim's ToMe r=13 and DynamicViT 0.7 beside the authors' forwards on the same weights, eager and compiled."""
    from dynamicvit_official_model import official_dynamicvit_model
    from tome_official import official_tome_model

    models = vit["models"]
    tome_label = next((label for label in models if label.startswith("tome")), None)
    dyn_label = next((label for label in models if label.startswith("dynamicvit")), None)
    pairs: dict[str, tuple[nn.Module, nn.Module]] = {}
    depth, heads = (4, 2) if run.small else (12, 12)
    patch = 8 if run.small else 16
    if tome_label is not None:
        ours = models[tome_label]
        r = ours.blocks[0].reducer.r if ours.blocks[0].reducer is not None else ours.blocks[1].reducer.r
        sd = {k: v.cpu() for k, v in ours.state_dict().items()}
        theirs = official_tome_model(sd, depth=depth, heads=heads, patch=patch, r=r).to(run.device)
        pairs["ToMe"] = (ours, theirs)
    if dyn_label is not None:
        ours = models[dyn_label]
        stages = [i for i, b in enumerate(ours.blocks) if b.reducer is not None]
        ratio = ours.blocks[stages[0]].reducer.keep_fraction
        sd = {k: v.cpu() for k, v in ours.state_dict().items()}
        theirs = official_dynamicvit_model(
            sd, depth=depth, heads=heads, patch=patch, pruning_loc=tuple(stages), keep_ratio=ratio
        ).to(run.device)
        pairs["DynamicViT"] = (ours, theirs)
    hw = tuple(vit["img_size"])
    out: dict[str, Any] = {}
    for name, (ours, theirs) in pairs.items():
        x = run.images(1, hw)  # type: ignore[arg-type]
        with torch.inference_mode():
            diff = float((ours(x).float() - theirs(x).float()).abs().max())
        out[name] = {"max_logit_diff_fp32": diff}
        for batch in run.batches:
            x = run.images(batch, hw)  # type: ignore[arg-type]
            timed = run.measure({"vitrim": run.eager(ours), "authors": run.eager(theirs)}, x)
            out[name][f"eager_{batch}"] = {k: 1e3 * v for k, v in timed.items()}
            out[name][f"eager_{batch}"]["authors_over_vitrim"] = timed["authors"] / timed["vitrim"]
            if not run.time_left(f"authors' {name}, compiled, batch {batch}"):
                continue
            fast = {"vitrim": run.optimized(ours, batch), "authors": run.compiled(theirs, batch)}
            timed = run.measure(fast, x)
            out[name][f"compiled_{batch}"] = {k: 1e3 * v for k, v in timed.items()}
            out[name][f"compiled_{batch}"]["authors_over_vitrim"] = timed["authors"] / timed["vitrim"]
            torch._dynamo.reset()
        print(f"  the authors' {name}: done", flush=True)
    return out


def profiles(run: Run, vit: dict[str, Any]) -> dict[str, Any]:
    """The 15 operators with the most self device time (CPU time without a GPU) in one eager forward."""
    from torch.profiler import ProfilerActivity, profile

    cuda = run.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    hw = tuple(vit["img_size"])
    out: dict[str, Any] = {}
    for label, model in vit["models"].items():
        if not (label == "dense" or label.startswith(("tome", "dynamicvit"))):
            continue
        for batch in run.batches:
            x = run.images(batch, hw)  # type: ignore[arg-type]
            fn = run.eager(model)
            fn(x)
            with profile(activities=activities) as recorded:
                fn(x)
                if cuda:
                    torch.cuda.synchronize()
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            ops = sorted(recorded.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:15]
            out[f"{label}, batch {batch}"] = [
                {"op": e.key, "calls": e.count, "self_ms": getattr(e, key, 0) / 1e3} for e in ops
            ]
    return out


def markdown(results: dict[str, Any]) -> str:
    """The tables of ``results`` with issue 27's targets beside each speed-up."""
    b1, bn = results["batches"]
    lines = [f"Device: {results['device']}, torch {results['torch']}, bf16 autocast: {results['bf16']}.", ""]
    for group, table in results["tables"].items():
        lines += [
            f"**{group}** (speed-up: eager over eager dense, graph over graph dense)",
            "",
            f"| setting | GFLOPs | FLOP ratio | batch {b1} eager ms | × | batch {b1} graph ms | × "
            f"| batch {bn} eager img/s | × | batch {bn} graph img/s | × | targets |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for label, row in table["rows"].items():
            cells = [label, f"{row['gflops']:.4g}", f"{row['flop_ratio']:.2f}"]
            for key, unit in ((f"eager_{b1}", "ms"), (f"graph_{b1}", "ms"), (f"eager_{bn}", "img_s"),
                              (f"graph_{bn}", "img_s")):  # fmt: skip
                value = row.get(key)
                cells += ["–", "–"] if value is None else [f"{value[unit]:.4g}", f"{value['speedup']:.2f}"]
            cells.append(_targets(row, b1, bn))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if results.get("authors"):
        lines += [
            "**The authors' code, same weights** (ms; ratio > 1: the authors' slower than vitrim)",
            "",
            "| method | mode | batch | vitrim ms | authors ms | authors / vitrim |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for method, entry in results["authors"].items():
            for key, value in entry.items():
                if isinstance(value, dict):
                    mode, batch = key.rsplit("_", 1)
                    lines.append(
                        f"| {method} | {mode} | {batch} | {value['vitrim']:.3f} | {value['authors']:.3f} | "
                        f"{value['authors_over_vitrim']:.2f} |"
                    )
        lines.append("")
    for name, ops in results.get("profiles", {}).items():
        lines += [f"Profile, {name}: " + ", ".join(f"{o['op']} {o['self_ms']:.2f} ms ({o['calls']})" for o in ops), ""]
    if results["skipped"]:
        lines += ["Skipped (time budget): " + "; ".join(results["skipped"]), ""]
    return "\n".join(lines)


def _targets(row: dict[str, Any], b1: int, bn: int) -> str:
    """Issue 27's targets for this row: met / NOT met (or – where not measured)."""
    reducer = row.get("reducer")
    if reducer is None:
        return ""
    wanted = {(b1, "graph"): 1.0, (bn, "graph"): 0.85 * row["flop_ratio"]}
    wanted.update({(b1 if b == 1 else bn, m): v for (b, m), v in TARGETS.get(reducer, {}).items()})
    notes = []
    for (batch, mode), target in sorted(wanted.items()):
        got = row.get(f"{mode}_{batch}")
        verdict = "–" if got is None else ("met" if got["speedup"] >= target else "NOT met")
        notes.append(f"b{batch} {mode} ≥{target:.2f}: {verdict}")
    return "; ".join(notes)


def timm_parity() -> dict[str, float] | None:
    """Max |vitrim − timm| logits, random weights timm made (small depth), float32 on the GPU's host CPU."""
    try:
        import timm
    except ImportError:
        return None
    small = dict(depth=2, num_classes=7)
    out = {}
    for name in ["deit3_small_patch16_224", "vit_small_patch14_dinov2", "vit_small_patch14_reg4_dinov2",
                 "vit_base_patch16_clip_224", "vit_base_patch16_siglip_224", "eva02_tiny_patch14_224",
                 "vit_medium_patch16_gap_256"]:  # fmt: skip
        torch.manual_seed(0)
        ref = timm.create_model(name, pretrained=False, dynamic_img_size=True, **small).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        sd = {k: v for k, v in ref.state_dict().items()}
        torch.save(sd, "/tmp/ref.pth")
        ours = vitrim.create_model(name, checkpoint="/tmp/ref.pth", **small).eval()
        side = ours.config.patch_size * 5
        x = torch.randn(2, 3, side, side + ours.config.patch_size)
        with torch.no_grad():
            out[name] = float((ours(x) - ref(x)).abs().max() / ref(x).abs().max())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_models"), help="folder for gpu_models.json and .md")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny models, batch 1 and 2: the smoke test")
    parser.add_argument("--reducers", default=None, help="comma-separated reducers for ViT-B (default: every one)")
    parser.add_argument("--budget-min", type=float, default=8.0, help="start no new compiled row after this long")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here (use --device cpu --small for the smoke run)")
    run = Run(args)
    chosen = None if args.reducers is None else tuple(r.strip() for r in args.reducers.split(","))
    tables, vit = {}, None
    for group, (model_name, overrides, names) in BACKBONES.items():
        if run.small and vit is not None:
            break  # the smoke run: one backbone
        print(group, flush=True)
        table = backbone_table(run, model_name, {**overrides, **(SMALL if run.small else {})}, names or chosen)
        tables[group] = table
        vit = vit or table
    assert vit is not None
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "bf16": run.dtype is not None,
        "batches": list(run.batches),
        "tables": {g: {k: v for k, v in t.items() if k != "models"} for g, t in tables.items()},
        "authors": authors_table(run, vit),
        "profiles": profiles(run, vit),
        "timm_parity": None if run.small else timm_parity(),
        "skipped": run.skipped,
        "minutes": (time.perf_counter() - run.start) / 60,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_models.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "gpu_models.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
