"""``vitrim train``: train a registered model on ``digits`` or an image folder (also under ``torchrun``)."""

from __future__ import annotations

import argparse
from typing import Any

from vitrim.cli.common import (
    BATCH,
    PROBABILITY,
    Bounded,
    add_data_arguments,
    add_threads_argument,
    check_output_folder,
    parse_model_set,
    parse_set,
)
from vitrim.data import Augment
from vitrim.train import TrainConfig, train

SET_FORM = "key=value[,key=value...]"  # --set and --distill (errors show it as --help does)


SMOOTHING = Bounded(float, 0.0, 1.0, "the target's mass spread over every class", high_open=True)
AREA = Bounded(float, 0.0, 1.0, "a share of the image's area", low_open=True)
BETA = Bounded(float, 0.0, 100.0, "a Beta distribution's alpha, 0: off")


def register(subparsers: argparse._SubParsersAction) -> None:
    d = TrainConfig.defaults()  # every default is TrainConfig's, written once there
    p = subparsers.add_parser(
        "train",
        help="train a model on digits, an image folder or shards (torchrun for DDP)",
        description="Train a registered model. Under `torchrun --nproc-per-node N` the same command runs DDP.",
    )
    p.add_argument("--model", required=True, help="registered model name (see `vitrim.list_models()`)")
    add_data_arguments(p, d)
    p.add_argument("--epochs", type=Bounded(int, 1, 100_000, "epochs"), default=d["epochs"])
    p.add_argument("--out", default=d["out"], help="run folder: checkpoints and metrics.jsonl")
    p.add_argument("--set", dest="overrides", action="append", metavar=SET_FORM, help="model override, repeatable")
    p.add_argument("--batch-size", type=BATCH, default=d["batch_size"], help="global batch size (split over ranks)")
    p.add_argument(
        "--accum-steps",
        type=Bounded(int, 1, 65536, "micro-batches per optimiser step, at most a batch of one image each"),
        default=d["accum_steps"],
        help="micro-batches per optimiser step (gradient accumulation; --batch-size stays the step's batch)",
    )
    p.add_argument(
        "--lr",
        type=Bounded(float, 0.0, 10.0, "a learning rate", low_open=True),
        default=d["lr"],
        help="peak AdamW learning rate",
    )
    p.add_argument(
        "--weight-decay", type=Bounded(float, 0.0, 10.0, "AdamW's decoupled weight decay"), default=d["weight_decay"]
    )
    p.add_argument(
        "--warmup-epochs", type=Bounded(float, 0.0, 100_000, "epochs of linear warm-up"), default=d["warmup_epochs"]
    )
    p.add_argument(
        "--min-lr-factor",
        type=Bounded(float, 0.0, 1.0, "the final lr's share of the peak"),
        default=d["min_lr_factor"],
        help="final lr = lr x this (cosine)",
    )
    p.add_argument("--label-smoothing", type=SMOOTHING, default=d["label_smoothing"])
    p.add_argument(
        "--clip-grad",
        type=Bounded(float, 0.0, 1e6, "a gradient norm, 0: no clipping"),
        default=d["clip_grad"],
        help="max gradient norm; 0 disables clipping",
    )
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--device", default=d["device"], choices=("auto", "cpu", "cuda"))
    add_threads_argument(p)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last.pt")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-epoch lines")
    add_augment_arguments(p, d)
    p.add_argument("--teacher", help="DynamicViT: dense checkpoint that initialises the backbone and the teacher")
    p.add_argument(
        "--backbone-lr-scale",
        type=Bounded(float, 0.0, 1000.0, "a multiplier of the lr"),
        default=d["backbone_lr_scale"],
        help="DynamicViT: backbone lr multiplier",
    )
    p.add_argument(
        "--freeze-backbone-epochs",
        type=Bounded(int, 0, 100_000, "epochs"),
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


def add_augment_arguments(p: argparse.ArgumentParser, d: dict) -> None:
    """The DeiT recipe's augmentations of image folders and shards (timm's train.py flags); digits keep their own."""
    group = p.add_argument_group("augmentation (image folders and shards; defaults: the DeiT recipe)")
    group.add_argument("--scale", type=AREA, nargs=2, default=d["scale"], metavar=("MIN", "MAX"),
                       help="RandomResizedCrop area range")  # fmt: skip
    group.add_argument("--hflip", type=PROBABILITY, default=d["hflip"], help="horizontal flip probability")
    group.add_argument(
        "--randaugment",
        type=Bounded(int, 0, 30, "RandAugment's magnitude, 0: off"),
        default=d["randaugment"],
        help="RandAugment magnitude; 0: off",
    )
    group.add_argument("--reprob", type=PROBABILITY, default=d["reprob"], help="random erasing probability")
    group.add_argument("--mixup", type=BETA, default=d["mixup"], help="mixup Beta alpha; 0: off")
    group.add_argument("--cutmix", type=BETA, default=d["cutmix"], help="cutmix Beta alpha; 0: off")
    group.add_argument(
        "--no-augment", action="store_true", help="none of them: the whole image resized, no flip, no mixing"
    )


def augment_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """TrainConfig's augmentation fields from the flags (``--no-augment`` turns every one off)."""
    if args.no_augment:
        off = Augment.none()
        return dict(scale=off.scale, hflip=0.0, randaugment=0, reprob=0.0, mixup=0.0, cutmix=0.0)
    return dict(
        scale=tuple(args.scale), hflip=args.hflip, randaugment=args.randaugment, reprob=args.reprob,
        mixup=args.mixup, cutmix=args.cutmix,
    )  # fmt: skip


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        data=args.data,
        val_data=args.val_data,
        workers=args.workers,
        accum_steps=args.accum_steps,
        **augment_from_args(args),
        out=str(check_output_folder(args.out, "--out")),
        epochs=args.epochs,
        overrides=parse_model_set(args.overrides, "--set", SET_FORM),
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
