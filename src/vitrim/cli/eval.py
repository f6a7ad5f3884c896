"""``vitrim eval CKPT``: top-1, top-5, loss, per-class accuracy and images/s of a trained model on a test split."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitrim.cli.common import BATCH, add_data_arguments
from vitrim.train import TrainConfig, evaluate_checkpoint


def register(subparsers: argparse._SubParsersAction) -> None:
    d = TrainConfig.defaults()  # evaluation batch and device as a run evaluates its epochs
    p = subparsers.add_parser(
        "eval",
        help="evaluate a checkpoint on digits, an image folder or shards",
        description="Evaluate a checkpoint. Data options default to those of the run that wrote it (its run.json), "
        "so the test split is the one the run held out. Other --data is evaluated on its val/ folder, or whole (a "
        "folder of class folders, shards).",
    )
    p.add_argument(
        "checkpoint",
        help="a .safetensors written by vitrim (best/last), a run's last.pt, or a hub repo 'hf-hub:ORG/NAME[@REV]' "
        "(timm or transformers layout; give --data)",
    )
    add_data_arguments(p)  # no defaults: the run's own
    p.add_argument("--split", choices=("test", "train"), default="test")
    p.add_argument("--batch-size", type=BATCH, default=d["eval_batch_size"])
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--device", default=d["device"], choices=("auto", "cpu", "cuda"))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="also write the metrics to FILE as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    metrics = evaluate_checkpoint(
        args.checkpoint,
        split=args.split,
        batch_size=args.batch_size,
        bf16=args.bf16,
        device=args.device,
        data=args.data,
        val_data=args.val_data,
        workers=args.workers,
        progress=not args.quiet and sys.stderr.isatty(),
        seed=args.seed,
        test_fraction=args.test_fraction,
        clutter=args.clutter,
        noise=args.noise,
        align=args.align,
    )
    print(f"{metrics['model']} on {metrics['data']} ({metrics['split']}, {metrics['num_samples']} images)")
    print(f"  top-1 {metrics['top1']:.4f}  top-5 {metrics['top5']:.4f}  loss {metrics['loss']:.4f}")
    print(
        f"  {metrics['images_per_s']:.0f} images/s end to end (reading, decoding, model); "
        f"the model alone {metrics['model_images_per_s']:.0f} images/s"
    )
    if metrics["num_skipped"]:
        print(f"  {metrics['num_skipped']} unreadable image(s) skipped")
    per_class = "  ".join(
        f"{name}: {'-' if acc is None else f'{acc:.3f}'}" for name, acc in zip(metrics["classes"], metrics["per_class"])
    )
    print(f"  per class: {per_class}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(metrics, indent=2) + "\n")
    return 0
