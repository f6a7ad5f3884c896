"""``vitrim viz rollout-memory``: peak memory of attention rollout, streaming against all-at-once.

Default: ViT-S/16 (random weights; memory does not depend on them) on one 1024×1024 image, N = 64² + 1 = 4097
tokens. Streaming (:func:`vitrim.viz.attention_rollout_model`) holds one block's (B, H, N, N) map and the (B, N, N)
accumulator; all-at-once (``forward_detailed(need_weights=True)`` then :func:`vitrim.viz.attention_rollout`)
holds every block's map: depth × B·H·N²·4 bytes (ViT-S at N = 4097: 12 × 403 MB ≈ 4.8 GB).

Each measurement runs in a fresh subprocess and reports the growth of the process's peak resident set (VmHWM)
over a baseline taken after the model is built and one small image has run (kernels loaded), as
``vitrim bench attention`` does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from vitrim.bench.allocator import pin_malloc_threshold
from vitrim.bench.attention import _peak_rss_bytes
from vitrim.models.config import ViTConfig
from vitrim.viz.maps import model_config

MODES = ("stream", "all")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("rollout-memory", help="peak memory of streaming vs all-at-once rollout")
    parser.add_argument("--model", default="vit_small_patch16_224", help="registered model (random weights)")
    parser.add_argument("--img-size", type=int, default=1024, help="square input side; N = (side / patch)² + 1")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--modes", default="stream", help="comma-separated: stream, all (all needs depth × N² RAM)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--_mode", dest="mode", default=None, help=argparse.SUPPRESS)  # internal: measure here
    parser.set_defaults(func=run)


def _build(args: argparse.Namespace) -> tuple[torch.nn.Module, ViTConfig]:
    import vitrim

    model = vitrim.create_model(args.model, img_size=args.img_size, num_classes=10).eval()
    return model, model_config(model)


def _rollout(model: torch.nn.Module, images: torch.Tensor, mode: str) -> torch.Tensor:
    from vitrim.viz.rollout import attention_rollout, attention_rollout_model, block_token_indices

    if mode == "stream":
        return attention_rollout_model(model, images)
    with torch.inference_mode():
        out = model.forward_detailed(images, need_weights=True)  # type: ignore[operator]
        prefix = model_config(model).num_prefix
        index = block_token_indices(out.block_positions, prefix)
        return attention_rollout(out.attentions, token_indices=index, num_prefix=prefix)


def _measure_here(args: argparse.Namespace) -> int:
    model, c = _build(args)
    _rollout(model, torch.randn(args.batch, c.in_chans, 2 * c.patch_size, 2 * c.patch_size), args.mode)
    images = torch.randn(args.batch, c.in_chans, args.img_size, args.img_size)
    before = _peak_rss_bytes()
    start = time.perf_counter()
    result = _rollout(model, images, args.mode)
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes() - before
    print(json.dumps({"peak_bytes": peak, "seconds": seconds, "tokens": result.shape[-1]}))
    return 0


def run(args: argparse.Namespace) -> int:
    for name in ("img_size", "batch"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.mode is not None:
        return _measure_here(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes must be a comma-separated subset of {MODES}, got {args.modes!r}")
    pin_malloc_threshold()
    _, c = _build(args)  # also validates the name and the size before any subprocess starts
    n = (args.img_size // c.patch_size) ** 2 + c.num_prefix
    one_map = args.batch * c.num_heads * n * n * 4
    print(f"rollout memory: {args.model}, {args.img_size}x{args.img_size}, B={args.batch}, N={n}, depth {c.depth}")
    print(
        f"  one block's attention map: {one_map / 2**20:9.1f} MiB; all {c.depth}: {c.depth * one_map / 2**20:9.1f} MiB"
    )
    results: dict[str, object] = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "mode")}}
    results["tokens"], results["one_map_mb"] = n, one_map / 2**20
    for mode in modes:
        cmd = [sys.executable, "-m", "vitrim.cli", "viz", "rollout-memory", "--_mode", mode, "--model", args.model]
        cmd += ["--img-size", str(args.img_size), "--batch", str(args.batch), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise ValueError(f"rollout-memory --_mode {mode} failed (exit {done.returncode}): {tail[0]}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        mb = measured["peak_bytes"] / 2**20
        results[mode] = {"peak_mb": mb, "seconds": measured["seconds"]}
        print(f"  {mode:>6}: peak RSS growth {mb:9.1f} MiB, {measured['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
