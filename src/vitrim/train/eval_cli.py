"""``vitrim eval CKPT``: top-1, top-5, loss, per-class accuracy and images/s of a trained model on a test split."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vitrim.data import build_datasets
from vitrim.train.distributed import barrier, cleanup_distributed, setup_distributed
from vitrim.train.evaluate import evaluate
from vitrim.train.loop import input_spec
from vitrim.train.state import load_for_eval

_DATA_DEFAULTS = {"data": "digits", "seed": 0, "test_fraction": 0.2, "clutter": 0, "noise": 0.0, "align": 1}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate a checkpoint on digits or an image folder",
        description="Evaluate a checkpoint. Data options default to those of the run that wrote it (its run.json), "
        "so the test split is the one the run held out.",
    )
    p.add_argument("checkpoint", help="a .safetensors written by vitrim (best/last) or a run's last.pt")
    p.add_argument("--data", help="'digits' or an image folder (default: the run's)")
    p.add_argument("--split", choices=("test", "train"), default="test")
    p.add_argument("--seed", type=int, help="split and placement seed (default: the run's)")
    p.add_argument("--test-fraction", type=float, help="(default: the run's)")
    p.add_argument("--clutter", type=int, help="digits (default: the run's)")
    p.add_argument("--noise", type=float, help="digits (default: the run's)")
    p.add_argument("--align", type=int, help="digits (default: the run's)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--json", dest="json_path", metavar="FILE", help="also write the metrics to FILE as JSON")
    p.set_defaults(func=run)


def evaluate_checkpoint(
    checkpoint: str | Path,
    *,
    split: str = "test",
    batch_size: int = 256,
    bf16: bool = False,
    device: str = "auto",
    **data_options: Any,
) -> dict[str, Any]:
    """Metrics of a checkpoint (see :func:`vitrim.train.evaluate.evaluate`); data options default to the run's."""
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch size must be a positive int, got {batch_size!r}")
    model, run = load_for_eval(checkpoint)
    options = {k: run.get(k, v) for k, v in _DATA_DEFAULTS.items()}
    options.update({k: v for k, v in data_options.items() if v is not None})
    data = options.pop("data")
    if data != "digits":
        for key in ("clutter", "noise", "align"):
            options.pop(key)
    if data != "digits" and not Path(data).is_dir():
        raise FileNotFoundError(f"data folder {data!r} does not exist (expected 'digits' or a folder)")
    info = setup_distributed(device)
    try:
        img_size, in_chans = input_spec(model)
        splits = build_datasets(data, img_size=img_size, in_chans=in_chans, **options)
        num_classes = int(getattr(model.config, "num_classes", splits.num_classes))
        if num_classes != splits.num_classes:
            raise ValueError(f"the model predicts {num_classes} classes but data {data!r} has {splits.num_classes}")
        dataset = splits.test if split == "test" else splits.train
        model = model.to(info.device)
        metrics = evaluate(model, dataset, num_classes=num_classes, batch_size=batch_size, info=info, bf16=bf16)
        barrier(info)
    finally:
        cleanup_distributed()
    return {
        "checkpoint": str(checkpoint),
        "model": run.get("model", type(model).__name__),
        "data": data,
        "split": split,
        "classes": splits.classes,
        **metrics,
    }


def run(args: argparse.Namespace) -> int:
    metrics = evaluate_checkpoint(
        args.checkpoint,
        split=args.split,
        batch_size=args.batch_size,
        bf16=args.bf16,
        device=args.device,
        data=args.data,
        seed=args.seed,
        test_fraction=args.test_fraction,
        clutter=args.clutter,
        noise=args.noise,
        align=args.align,
    )
    print(f"{metrics['model']} on {metrics['data']} ({metrics['split']}, {metrics['num_samples']} images)")
    print(f"  top-1 {metrics['top1']:.4f}  top-5 {metrics['top5']:.4f}  loss {metrics['loss']:.4f}")
    print(f"  {metrics['images_per_s']:.0f} images/s")
    per_class = "  ".join(
        f"{name}: {'-' if acc is None else f'{acc:.3f}'}" for name, acc in zip(metrics["classes"], metrics["per_class"])
    )
    print(f"  per class: {per_class}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(metrics, indent=2) + "\n")
    return 0
