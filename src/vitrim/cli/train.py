"""``vitrim train``: train a registered model on ``digits`` or an image folder (also under ``torchrun``)."""

from __future__ import annotations

import argparse

from vitrim.cli.common import add_data_arguments, add_threads_argument, check_output_folder, parse_set
from vitrim.train import TrainConfig, train

SET_FORM = "key=value[,key=value...]"  # --set and --distill (errors show it as --help does)


def register(subparsers: argparse._SubParsersAction) -> None:
    d = TrainConfig.defaults()  # every default is TrainConfig's, written once there
    p = subparsers.add_parser(
        "train",
        help="train a model on digits or an image folder (torchrun for DDP)",
        description="Train a registered model. Under `torchrun --nproc-per-node N` the same command runs DDP.",
    )
    p.add_argument("--model", required=True, help="registered model name (see `vitrim.list_models()`)")
    add_data_arguments(p, d)
    p.add_argument("--epochs", type=int, default=d["epochs"])
    p.add_argument("--out", default=d["out"], help="run folder: checkpoints and metrics.jsonl")
    p.add_argument("--set", dest="overrides", action="append", metavar=SET_FORM, help="model override, repeatable")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="global batch size (split over ranks)")
    p.add_argument("--lr", type=float, default=d["lr"], help="peak AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    p.add_argument("--warmup-epochs", type=float, default=d["warmup_epochs"])
    p.add_argument("--min-lr-factor", type=float, default=d["min_lr_factor"], help="final lr = lr x this (cosine)")
    p.add_argument("--label-smoothing", type=float, default=d["label_smoothing"])
    p.add_argument("--clip-grad", type=float, default=d["clip_grad"], help="max gradient norm; 0 disables clipping")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--device", default=d["device"], choices=("auto", "cpu", "cuda"))
    add_threads_argument(p)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last.pt")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-epoch lines")
    p.add_argument("--teacher", help="DynamicViT: dense checkpoint that initialises the backbone and the teacher")
    p.add_argument(
        "--backbone-lr-scale", type=float, default=d["backbone_lr_scale"], help="DynamicViT: backbone lr multiplier"
    )
    p.add_argument(
        "--freeze-backbone-epochs",
        type=int,
        default=d["freeze_backbone_epochs"],
        help="DynamicViT: epochs with a frozen backbone",
    )
    p.add_argument(
        "--distill", action="append", metavar=SET_FORM, help="DynamicViT: DynamicViTLoss keyword, repeatable"
    )
    p.add_argument(
        "--mctf",
        action="append",
        metavar=SET_FORM,
        help="MCTF models: teacher_r, teacher_weight, consistency_weight, confidence (defaults 8, 1, 3, 0.4)",
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        data=args.data,
        out=str(check_output_folder(args.out, "--out")),
        epochs=args.epochs,
        overrides=parse_set(args.overrides, "--set", SET_FORM),
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
        distill=parse_set(args.distill, "--distill", SET_FORM),
        mctf=parse_set(args.mctf, "--mctf", SET_FORM),
    )


def run(args: argparse.Namespace) -> int:
    result = train(config_from_args(args))
    if not args.quiet and result["rank"] == 0:
        top1, best = result["test_top1"], result["best_top1"]
        print(f"done: test top-1 {top1:.4f} (best {best:.4f}); run folder {result['out']}")
    return 0
