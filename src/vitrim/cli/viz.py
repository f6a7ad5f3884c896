"""``vitrim viz attention|rollout|relevance|tokens|rollout-memory``: pictures of what a model attends to and keeps.

    vitrim viz attention --checkpoint run/model.safetensors --digits 3 --out attn.png
    vitrim viz rollout   --checkpoint run/model.safetensors --image cat.jpg --out rollout.png
    vitrim viz relevance --checkpoint run/model.safetensors --digits 3 --class 7 --method attnlrp --out rel.png
    vitrim viz tokens    --checkpoint run/dynamicvit.safetensors --digits 0 --out kept.png
    vitrim viz rollout-memory                      # peak memory of streaming rollout at N = 4096 (ViT-S)

The model comes from ``--checkpoint`` (``vitrim.load_model``: a file or ``hf-hub:ORG/NAME``) or, to try the pictures
without a trained model, ``--model NAME`` (random weights). The picture is ``--image`` (PNG/JPEG; a model with a
data config gets its own eval transform, ``vitrim.data.eval_transform``; a model vitrim trained is converted to its
channels, resized to its img_size and normalised with mean 0.5 and std 0.5, as vitrim's data pipeline does) or
``--digits K``
(the K-th test image of the bundled digits set, drawn as ``vitrim train`` draws it by default).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor, nn

import vitrim
from vitrim.bench import rollout as rollout_bench
from vitrim.bench.allocator import pin_malloc_threshold
from vitrim.cli.common import BATCH, IMAGE_SIDE, Bounded, add_threads_argument, check_output_file
from vitrim.data import DigitsCanvas
from vitrim.data.images import read_image
from vitrim.data.transforms import read_image_for
from vitrim.extras import require
from vitrim.models.config_limits import LIMITS
from vitrim.viz.maps import model_attention_grid, model_config, plot_attention_maps, plot_rollout, save_figure
from vitrim.viz.relevance import METHODS, relevance_map
from vitrim.viz.relevance_plot import plot_relevance
from vitrim.viz.rollout import HEAD_FUSIONS, attention_rollout_model
from vitrim.viz.tokens import model_kept_indices, plot_kept_tokens
from vitrim.weights.hub import is_hub_name

DISCARD = Bounded(float, 0.0, 1.0, "the share of each block's weakest links dropped", high_open=True)
CLASS = Bounded(int, 0, LIMITS["num_classes"] - 1, "a class index of the model's head")

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("viz", help="draw attention maps, rollout or kept tokens of a model")
    kinds = parser.add_subparsers(dest="viz_kind", required=True, metavar="KIND")
    helps = {
        "attention": "[CLS] -> patch attention of every block and head, over the image",
        "rollout": "attention rollout (Abnar & Zuidema 2020) of [CLS] over the image",
        "relevance": "class-specific relevance (Chefer et al. 2021, AttnLRP) of every patch, through any reducer",
        "tokens": "the patches a DynamicViT keeps at each stage",
    }
    for kind, text in helps.items():
        p = kinds.add_parser(kind, help=text)
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument(
            "--checkpoint",
            help="a model file written by vitrim, or a hub repo 'hf-hub:ORG/NAME[@REV]' (vitrim.load_model)",
        )
        source.add_argument("--model", help="a registered model name with random weights (to try the pictures)")
        picture = p.add_mutually_exclusive_group(required=True)
        picture.add_argument("--image", help="a PNG or JPEG file")
        picture.add_argument(
            "--digits",
            type=Bounded(int, 0, 99_999, "an index into the test digits"),
            metavar="K",
            help="the K-th test image of the bundled digits",
        )
        p.add_argument("--img-size", type=IMAGE_SIDE, default=None, help="with --model: its image size")
        p.add_argument("--out", required=True, help="PNG file to write")
        if kind == "rollout":
            p.add_argument("--head-fusion", choices=HEAD_FUSIONS, default="mean")
            p.add_argument("--discard-ratio", type=DISCARD, default=0.0, help="weakest links dropped per block, [0, 1)")
        if kind == "relevance":
            p.add_argument("--class", dest="target", type=CLASS, default=None, metavar="K",
                           help="class to explain (default: the predicted one)")  # fmt: skip
            p.add_argument("--method", choices=METHODS, default="chefer", help="relevance method (default chefer)")
            p.add_argument("--reducer", default=None, metavar="SPEC",
                           help="apply a training-free reducer first, e.g. 'tome:r=3'")  # fmt: skip
        p.set_defaults(func=run)
    p = kinds.add_parser("rollout-memory", help="peak memory of streaming vs all-at-once rollout")
    p.add_argument("--model", default="vit_small_patch16_224", help="registered model (random weights)")
    p.add_argument("--img-size", type=IMAGE_SIDE, default=1024, help="square input side; N = (side / patch)² + 1")
    p.add_argument("--batch", type=BATCH, default=1)
    p.add_argument("--modes", default="stream", help="comma-separated: stream, all (all needs depth × N² RAM)")
    add_threads_argument(p)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=run_rollout_memory)


def load_viz_model(args: argparse.Namespace) -> nn.Module:
    """The model named by ``--checkpoint`` or ``--model``, in eval mode."""
    if args.checkpoint is not None:
        if not is_hub_name(args.checkpoint) and not Path(args.checkpoint).exists():
            raise FileNotFoundError(f"--checkpoint {args.checkpoint!r} does not exist")
        model = vitrim.load_model(args.checkpoint)
    else:
        kwargs = {} if args.img_size is None else {"img_size": args.img_size}
        model = vitrim.create_model(args.model, **kwargs)
    model_config(model)  # a vitrim Vision Transformer, or a clear TypeError
    return model.eval()


def load_picture(args: argparse.Namespace, model: nn.Module) -> Tensor:
    """The image (C, H, W) float32 the model sees, from ``--image`` or ``--digits``."""
    config = model_config(model)
    height, width = config.img_size
    if args.image is not None:
        data = getattr(model, "data_config", None)  # the preprocessing its weights expect; vitrim's own otherwise
        if data is None:
            return read_image(args.image, (height, width), config.in_chans, name="--image")
        return read_image_for(args.image, data, name="--image")
    if height != width:
        raise ValueError(f"--digits needs a model with a square img_size, got {config.img_size}")
    dataset = DigitsCanvas("test", canvas_size=height, in_chans=config.in_chans)
    if not 0 <= args.digits < len(dataset):
        raise ValueError(f"--digits must be in [0, {len(dataset)}), the test digits, got {args.digits}")
    image, _ = dataset[args.digits]
    return image


def run(args: argparse.Namespace) -> int:
    out = check_output_file(args.out, "--out")
    require("matplotlib", feature="drawing")
    if args.img_size is not None and args.checkpoint is not None:
        raise ValueError("--img-size applies to --model only; a checkpoint carries its own image size")
    model = load_viz_model(args)
    image = load_picture(args, model)
    name = Path(args.checkpoint).name if args.checkpoint else args.model
    if args.viz_kind == "attention":
        maps, logits = model_attention_grid(model, image)
        fig = plot_attention_maps(image, maps, title=f"{name}\n[CLS] → patch attention; predicted class {_top(logits)}")
    elif args.viz_kind == "rollout":
        rollout = attention_rollout_model(model, image[None], args.head_fusion, args.discard_ratio)  # (1, N, N)
        config = model_config(model)
        prefix = config.num_prefix
        grid = (image.shape[-2] // config.patch_size, image.shape[-1] // config.patch_size)
        relevance = rollout[0, 0, prefix:].reshape(grid)  # (gh, gw): [CLS]'s share of each input patch
        title = f"{name}: rollout (heads: {args.head_fusion}, discard ratio {args.discard_ratio})"
        fig = plot_rollout(image, relevance, title=title)
    elif args.viz_kind == "relevance":
        fig = _relevance_figure(args, model, image, name)
    else:
        if not hasattr(model, "pruners"):
            raise ValueError(
                f"vitrim viz tokens needs a DynamicViT (dynamicvit_* model); {name!r} is a {type(model).__name__}"
            )
        kept, grid = model_kept_indices(model, image)
        fig, _ = plot_kept_tokens(image, kept, grid, title=f"{name}: kept tokens per stage")
    save_figure(fig, out)
    print(f"wrote {out}")
    return 0


def _relevance_figure(args: argparse.Namespace, model: nn.Module, image: Tensor, name: str) -> Figure:
    """The relevance picture for ``vitrim viz relevance`` (image | map | overlay | kept and merged patches)."""
    num_classes = model_config(model).num_classes
    if args.target is not None and not 0 <= args.target < num_classes:
        raise ValueError(f"--class must be a class index in [0, {num_classes}), got {args.target}")
    if args.reducer is not None:
        reducer, options = vitrim.reduce.parse_spec(args.reducer)
        vitrim.reduce.apply(model, reducer, **options)
    result = relevance_map(model, image[None], args.target, method=args.method)
    explained = int(result.target[0])
    predicted = int(result.logits[0].argmax())
    title = f"{name}: {args.method} relevance for class {explained} (predicted {predicted})"
    mapping = None if result.patch_to_token is None else result.patch_to_token[0]
    return plot_relevance(
        image, result.grid[0], patch_to_token=mapping, title=title, label=f"{args.method}: class {explained}"
    )


def _top(logits: Tensor) -> str:
    return str(int(logits.argmax()))


def run_rollout_memory(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in rollout_bench.MODES]
    if bad or not modes:
        raise ValueError(f"--modes must be a comma-separated subset of {rollout_bench.MODES}, got {args.modes!r}")
    pin_malloc_threshold()
    _, c = rollout_bench.build(args.model, args.img_size)  # validates the name and the size before measuring
    n = (args.img_size // c.patch_size) ** 2 + c.num_prefix
    one_map = args.batch * c.num_heads * n * n * 4
    print(f"rollout memory: {args.model}, {args.img_size}x{args.img_size}, B={args.batch}, N={n}, depth {c.depth}")
    print(
        f"  one block's attention map: {one_map / 2**20:9.1f} MiB; all {c.depth}: {c.depth * one_map / 2**20:9.1f} MiB"
    )
    results: dict[str, object] = {"config": {k: v for k, v in vars(args).items() if k != "func"}}
    results["tokens"], results["one_map_mb"] = n, one_map / 2**20
    for mode in modes:
        measured = rollout_bench.measure(args.model, args.img_size, args.batch, mode)
        mb = measured["peak_bytes"] / 2**20
        results[mode] = {"peak_mb": mb, "seconds": measured["seconds"]}
        print(f"  {mode:>6}: peak RSS growth {mb:9.1f} MiB, {measured['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
