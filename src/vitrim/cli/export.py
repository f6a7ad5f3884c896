"""``vitrim export CHECKPOINT --onnx out.onnx``: write a model, with its token reducers, as an ONNX graph."""

from __future__ import annotations

import argparse
from pathlib import Path

from torch import nn

from vitrim import reduce
from vitrim.cli.common import BATCH, IMAGE_SIDE, Bounded, check_output_folder
from vitrim.export import compare_with_onnxruntime, export_onnx
from vitrim.factory import create_model
from vitrim.train.state import load_for_eval
from vitrim.weights.hub import is_hub_name


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a checkpoint (any model kind, with token reducers) to ONNX",
        description="Export a checkpoint to ONNX with torch's dynamo exporter, in eval mode, with a dynamic batch "
        "dimension (input 'images' (B, C, H, W) float32, output 'logits' (B, classes)).",
    )
    parser.add_argument(
        "checkpoint",
        help="a .safetensors written by vitrim (its metadata says how to build the model), a run's last.pt, or a hub "
        "repo 'hf-hub:ORG/NAME[@REV]'; with --model, any checkpoint create_model loads (timm, DeiT, HF, official "
        "DynamicViT, a hub repo's weights)",
    )
    parser.add_argument("--onnx", required=True, metavar="OUT", help="the .onnx file to write")
    parser.add_argument("--model", help="registered model name to build when the checkpoint does not say")
    parser.add_argument(
        "--reducer", help="token reducer to attach before exporting, e.g. tome:r=13, 'evit:keep_rate=0.7'"
    )
    parser.add_argument("--img-size", type=IMAGE_SIDE, default=None, help="input side (default: the model's own)")
    parser.add_argument("--static-batch", action="store_true", help="fix the batch size to --batch-size")
    parser.add_argument("--batch-size", type=BATCH, default=2, help="batch of the example input (default 2)")
    parser.add_argument(
        "--opset",
        type=Bounded(int, 1, 99, "an ONNX opset: numbered from 1; the exporter says which it can write"),
        default=None,
        help="ONNX opset (default: torch's)",
    )
    parser.add_argument(
        "--check", action="store_true", help="run the file in onnxruntime and print the max logit difference"
    )
    parser.set_defaults(func=run)


def load(checkpoint: str, model_name: str | None, reducer: str | None) -> nn.Module:
    """The model to export: built from the checkpoint (or ``model_name``), with ``reducer`` attached, in eval mode."""
    if not is_hub_name(checkpoint) and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint!r} does not exist or is not a file")
    model = create_model(model_name, checkpoint=checkpoint) if model_name is not None else load_for_eval(checkpoint)[0]
    if reducer is not None:
        name, options = reduce.parse_spec(reducer)
        reduce.apply(model, name, **options)
    return model.eval()


def run(args: argparse.Namespace) -> int:
    out = Path(args.onnx)
    check_output_folder(str(out.parent), "--onnx")  # created if missing, but nothing on its way may be a file
    if out.is_dir():
        raise ValueError(f"--onnx {args.onnx!r} is a folder, expected a file name")
    if args.img_size is not None and args.img_size < 1:
        raise ValueError(f"--img-size must be >= 1, got {args.img_size}")
    model = load(args.checkpoint, args.model, args.reducer)
    path = export_onnx(
        model,
        out,
        img_size=args.img_size,
        batch_size=args.batch_size,
        dynamic_batch=not args.static_batch,
        opset_version=args.opset,
    )
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    if args.check:
        batches = (args.batch_size,) if args.static_batch else (1, args.batch_size + 1)
        diff = compare_with_onnxruntime(model, path, batch_sizes=batches, img_size=args.img_size)
        print(f"onnxruntime vs PyTorch, batch sizes {list(batches)}: max |logit difference| {diff:.2e}")
    return 0
