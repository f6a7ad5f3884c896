"""GPU throughput of vitrim's models and reducers in bf16, next to timm's own ViT on the same weights, and a check of
every family against timm where timm is installed. Run on a machine with CUDA:

    PYTHONPATH=src python benchmarks/gpu_models.py results.json

Timing: CUDA events around each call, the cases interleaved within every repeat (so all see the same clocks and
load), median of the repeats after warm-up; bf16 autocast, eval, inference_mode. GFLOPs: vitrim.bench.flops on the
eager model at batch 1 (matrix products, 2 per multiply-add).
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

import torch

import vitrim
from vitrim.bench.flops import model_flops_per_image

DEVICE = "cuda"


def timed(fn: Any, x: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def measure(cases: dict[str, tuple[Any, tuple[int, int]]], batch: int, repeats: int, warmup: int = 5) -> dict:
    inputs = {name: torch.randn(batch, 3, *hw, device=DEVICE) for name, (_, hw) in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(warmup):
            for name, (fn, _) in cases.items():
                fn(inputs[name])
        for _ in range(repeats):
            for name, (fn, _) in cases.items():
                samples[name].append(timed(fn, inputs[name]))
    return {
        name: {"ms": 1e3 * statistics.median(s), "img_s": batch / statistics.median(s)} for name, s in samples.items()
    }


def build(name: str, **options: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return vitrim.create_model(name, **options).eval()


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` of the model on the GPU (default mode); compiled on first call, during the warm-up."""
    return torch.compile(model.to(DEVICE))  # type: ignore[return-value]


def main(path: str) -> None:
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    base = build("vit_base_patch16_224")
    groups: dict[str, dict[str, torch.nn.Module]] = {
        "ViT-B/16 @224": {
            "dense": base,
            "ToMe r=13": vitrim.reduce.apply(build("vit_base_patch16_224"), "tome", r=13),
            "DynamicViT 0.7": build("dynamicvit_base_patch16_224", keep_ratio=0.7),
            "MCTF r=16": build("vit_base_patch16_224", reducer="mctf", r=16),
            "dense, torch.compile": compiled(build("vit_base_patch16_224")),
            "ToMe r=13, torch.compile": compiled(build("vit_base_patch16_224", reducer="tome", r=13)),
        },
        "DINOv2-S/14-reg4 @224": {
            "dense": build("vit_small_patch14_reg4_dinov2", img_size=224),
            "ToMe r=13": build("vit_small_patch14_reg4_dinov2", img_size=224, reducer="tome", r=13),
            "DynamicViT 0.7": build("vit_small_patch14_reg4_dinov2", img_size=224, reducer="dynamicvit"),
        },
        "SigLIP-B/16 @224": {
            "dense": build("vit_base_patch16_siglip_224"),
            "ToMe r=13": build("vit_base_patch16_siglip_224", reducer="tome", r=13),
            "DynamicViT 0.7": build("vit_base_patch16_siglip_224", reducer="dynamicvit"),
        },
    }
    try:
        import timm

        reference = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
        reference.load_state_dict(base.state_dict())
        groups["ViT-B/16 @224"]["timm's own ViT-B/16, same weights"] = reference
        results["timm"] = timm.__version__
    except ImportError:
        results["timm"] = None
    for group, models in groups.items():
        flops = {}
        for name, model in models.items():
            model.to(DEVICE)
            if name.startswith("timm"):
                flops[name] = flops["dense"]
                continue
            if name.endswith(", torch.compile"):  # the same computation as the eager row
                flops[name] = flops[name.removesuffix(", torch.compile")]
                continue
            size = model.config.img_size
            flops[name] = model_flops_per_image(model.cpu(), size, 3) / 1e9
            model.to(DEVICE)
        cases = {name: (model, tuple(base.config.img_size if group.startswith("ViT-B") else model.config.img_size))
                 for name, model in models.items()}  # fmt: skip
        rows: dict[str, Any] = {name: {"gflops": flops[name]} for name in models}
        for batch, repeats in ((1, 50), (256, 10)):
            timing = measure(cases, batch, repeats)  # type: ignore[arg-type]
            for name in models:
                rows[name][f"batch{batch}"] = timing[name]
                rows[name][f"speedup{batch}"] = timing[name]["img_s"] / timing["dense"]["img_s"]
        results[group] = rows
        print(group, json.dumps(rows, indent=1), flush=True)
    results["timm_parity"] = timm_parity()
    with open(path, "w") as f:
        json.dump(results, f, indent=2)


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


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_models.json")
