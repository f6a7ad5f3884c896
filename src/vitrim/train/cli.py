"""``vitrim train``: train a registered model on ``digits`` or an image folder (also under ``torchrun``)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from vitrim.literals import parse_value
from vitrim.train.loop import TrainConfig, train


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["depth=4", "img_size=32", "global_pool='avg'"]`` -> ``{"depth": 4, "img_size": 32, "global_pool": "avg"}``.

    Values are Python literals (numbers, booleans, tuples, quoted strings); anything else is taken as a string.
    """
    overrides: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"--set expects key=value with a Python name as key, got {item!r}")
        overrides[key] = parse_value(text)
    return overrides


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="digits", help="'digits' (bundled) or an image folder (default: digits)")
    parser.add_argument("--test-fraction", type=float, default=0.2, help="test share of each class (default 0.2)")
    parser.add_argument("--clutter", type=int, default=0, help="digits: fragments of other digits per image")
    parser.add_argument("--noise", type=float, default=0.0, help="digits: std of Gaussian pixel noise")
    parser.add_argument("--align", type=int, default=1, help="digits: place digits on multiples of this many pixels")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, placements, order and init")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch (default: torch's choice). On a machine shared with other jobs, 1 can be many "
        "times faster than 2: threads that wait for each other lose their cores",
    )


def set_threads(threads: int) -> None:
    """Apply ``--threads`` (0 keeps torch's default)."""
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be an int >= 0, got {threads!r}")
    if threads:
        torch.set_num_threads(threads)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model on digits or an image folder (torchrun for DDP)",
        description="Train a registered model. Under `torchrun --nproc-per-node N` the same command runs DDP.",
    )
    p.add_argument("--model", required=True, help="registered model name (see `vitrim.list_models()`)")
    add_data_arguments(p)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--out", default="runs/train", help="run folder: checkpoints and metrics.jsonl")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE", help="model override, repeatable")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size (split over ranks)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--min-lr-factor", type=float, default=0.01, help="final lr = lr x this (cosine)")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm; 0 disables clipping")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    add_threads_argument(p)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last.pt")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-epoch lines")
    p.add_argument("--teacher", help="DynamicViT: dense checkpoint that initialises the backbone and the teacher")
    p.add_argument("--backbone-lr-scale", type=float, default=0.01, help="DynamicViT: backbone lr multiplier")
    p.add_argument("--freeze-backbone-epochs", type=int, default=1, help="DynamicViT: epochs with a frozen backbone")
    p.add_argument(
        "--distill", action="append", metavar="KEY=VALUE", help="DynamicViT: DynamicViTLoss keyword, repeatable"
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        data=args.data,
        out=args.out,
        epochs=args.epochs,
        overrides=parse_overrides(args.overrides),
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_epochs=args.warmup_epochs,
        min_lr_factor=args.min_lr_factor,
        label_smoothing=args.label_smoothing,
        clip_grad=args.clip_grad if args.clip_grad > 0 else None,
        bf16=args.bf16,
        seed=args.seed,
        resume=args.resume,
        quiet=args.quiet,
        device=args.device,
        test_fraction=args.test_fraction,
        clutter=args.clutter,
        noise=args.noise,
        align=args.align,
        teacher=args.teacher,
        backbone_lr_scale=args.backbone_lr_scale,
        freeze_backbone_epochs=args.freeze_backbone_epochs,
        distill=parse_overrides(args.distill),
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    config.validate()
    set_threads(args.threads)
    result = train(config)
    if not args.quiet and result["rank"] == 0:
        top1, best = result["test_top1"], result["best_top1"]
        print(f"done: test top-1 {top1:.4f} (best {best:.4f}); run folder {result['out']}")
    return 0
