"""``vitrim viz attention|rollout|tokens|rollout-memory``: pictures of what a model attends to and keeps.

    vitrim viz attention --checkpoint run/model.safetensors --digits 3 --out attn.png
    vitrim viz rollout   --checkpoint run/model.safetensors --image cat.jpg --out rollout.png
    vitrim viz tokens    --checkpoint run/dynamicvit.safetensors --digits 0 --out kept.png
    vitrim viz rollout-memory                      # peak memory of streaming rollout at N = 4096 (ViT-S)

The model comes from ``--checkpoint`` (``vitrim.load_model``) or, to try the pictures without a trained model,
``--model NAME`` (random weights). The picture is ``--image`` (PNG/JPEG, converted to the model's channels,
resized to its img_size, normalised with mean 0.5 and std 0.5 as vitrim's data pipeline does) or ``--digits K``
(the K-th test image of the bundled digits set, drawn as ``vitrim train`` draws it by default).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from vitrim.viz.maps import model_attention_grid, model_config, plot_attention_maps, plot_rollout, save_figure
from vitrim.viz.rollout import HEAD_FUSIONS, attention_rollout_model
from vitrim.viz.tokens import model_kept_indices, plot_kept_tokens

NORMALISE_MEAN, NORMALISE_STD = 0.5, 0.5  # vitrim.data's: [0, 1] -> [-1, 1]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("viz", help="draw attention maps, rollout or kept tokens of a model")
    kinds = parser.add_subparsers(dest="viz_kind", required=True, metavar="KIND")
    helps = {
        "attention": "[CLS] -> patch attention of every block and head, over the image",
        "rollout": "attention rollout (Abnar & Zuidema 2020) of [CLS] over the image",
        "tokens": "the patches a DynamicViT keeps at each stage",
    }
    for kind, text in helps.items():
        p = kinds.add_parser(kind, help=text)
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("--checkpoint", help="a model file written by vitrim (vitrim.load_model)")
        source.add_argument("--model", help="a registered model name with random weights (to try the pictures)")
        picture = p.add_mutually_exclusive_group(required=True)
        picture.add_argument("--image", help="a PNG or JPEG file")
        picture.add_argument("--digits", type=int, metavar="K", help="the K-th test image of the bundled digits")
        p.add_argument("--img-size", type=int, default=None, help="with --model: its image size")
        p.add_argument("--out", required=True, help="PNG file to write")
        if kind == "rollout":
            p.add_argument("--head-fusion", choices=HEAD_FUSIONS, default="mean")
            p.add_argument("--discard-ratio", type=float, default=0.0, help="weakest links dropped per block, [0, 1)")
        p.set_defaults(func=run)
    from vitrim.bench import rollout as rollout_bench

    rollout_bench.register(kinds)


def load_viz_model(args: argparse.Namespace) -> nn.Module:
    """The model named by ``--checkpoint`` or ``--model``, in eval mode."""
    if args.checkpoint is not None:
        path = Path(args.checkpoint)
        if not path.exists():
            raise FileNotFoundError(f"--checkpoint {args.checkpoint!r} does not exist")
        import vitrim

        model = vitrim.load_model(path)
    else:
        import vitrim

        kwargs = {} if args.img_size is None else {"img_size": args.img_size}
        model = vitrim.create_model(args.model, **kwargs)
    model_config(model)  # a vitrim Vision Transformer, or a clear TypeError
    return model.eval()


def load_picture(args: argparse.Namespace, model: nn.Module) -> Tensor:
    """The image (C, H, W) float32 the model sees, from ``--image`` or ``--digits``."""
    config = model_config(model)
    height, width = config.img_size
    if args.image is not None:
        return read_image(args.image, (height, width), config.in_chans)
    from vitrim.data import DigitsCanvas

    if height != width:
        raise ValueError(f"--digits needs a model with a square img_size, got {config.img_size}")
    dataset = DigitsCanvas("test", canvas_size=height, in_chans=config.in_chans)
    if not 0 <= args.digits < len(dataset):
        raise ValueError(f"--digits must be in [0, {len(dataset)}), the test digits, got {args.digits}")
    image, _ = dataset[args.digits]
    return image


def read_image(path: str | Path, size: tuple[int, int], in_chans: int) -> Tensor:
    """A PNG/JPEG file -> (in_chans, H, W) float32 normalised to [-1, 1]; ``size`` is (H, W)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--image {str(path)!r} does not exist")
    if in_chans not in (1, 3):
        raise ValueError(f"images can be read for models with 1 or 3 input channels, not in_chans={in_chans}")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as file:
            img = file.convert("L" if in_chans == 1 else "RGB").resize((size[1], size[0]), Image.Resampling.BILINEAR)
            array = np.asarray(img, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"--image {str(path)!r} is not a readable PNG/JPEG image ({err})") from None
    chw = array[None] if in_chans == 1 else array.transpose(2, 0, 1)
    return (torch.from_numpy(chw.copy()) - NORMALISE_MEAN) / NORMALISE_STD


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not out.parent.exists():
        raise FileNotFoundError(f"--out {args.out!r}: folder {str(out.parent)!r} does not exist")
    if args.img_size is not None and args.checkpoint is not None:
        raise ValueError("--img-size applies to --model only; a checkpoint carries its own image size")
    if args.viz_kind == "rollout" and not 0.0 <= args.discard_ratio < 1.0:
        raise ValueError(f"--discard-ratio must be in [0, 1), got {args.discard_ratio}")
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


def _top(logits: Tensor) -> str:
    return str(int(logits.argmax()))
