"""Is ``vitrim eval`` on a folder bound by decoding? The loader alone, the model alone and both, side by side.

    PYTHONPATH=src python benchmarks/eval_throughput.py --images 256 --workers 2 --batch-size 64 --rounds 3

It writes an ImageNet-like validation folder (``--images`` JPEGs of 500x375, ImageNet's median size, smooth colour
fields with noise, quality 90, over 10 classes) and takes a ViT-S/16 at 224 (random weights: speed does not depend
on them) with its eval transform (resize 248, centre crop 224, normalise). Each round measures, in turns:

* loader: the evaluation DataLoader alone (``--workers`` processes read, decode, resize, crop, normalise, batch);
* model: ViT-S forwards on one batch already in memory (batch ``--batch-size``, inference mode);
* both: :func:`vitrim.train.evaluate` end to end (what ``vitrim eval`` runs).

It prints the images/s of each (median over rounds) and both / model: near 1, the model sets the pace and decoding
hides behind it in the workers; far below 1, decoding binds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import vitrim
from vitrim.data import build_datasets
from vitrim.train.distributed import DistInfo
from vitrim.train.evaluate import evaluate
from vitrim.train.loaders import eval_batches


def make_folder(root: Path, num_images: int, seed: int = 0) -> Path:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:375, 0:500] / 500.0
    for i in range(num_images):
        label = i % 10
        folder = root / "val" / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        (root / "train" / f"class_{label}").mkdir(parents=True, exist_ok=True)
        a, b, c = rng.uniform(0, 2 * np.pi, 3)
        field = np.stack([np.sin(3 * x + a), np.cos(4 * y + b), np.sin(2 * (x + y) + c)], axis=-1)
        pixels = 127 + 100 * field + rng.normal(0, 12, field.shape)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i:06d}.JPEG", quality=90)
    for label in range(10):  # one training image per class: the layout wants train/ beside val/
        src = next((root / "val" / f"class_{label}").iterdir())
        (root / "train" / f"class_{label}" / src.name).write_bytes(src.read_bytes())
    return root


def loader_rate(dataset: torch.utils.data.Dataset, batch_size: int, workers: int) -> float:
    start, seen = time.perf_counter(), 0
    for _, labels in eval_batches(dataset, batch_size=batch_size, info=DistInfo(), workers=workers, source="bench"):
        seen += len(labels)
    return seen / (time.perf_counter() - start)


@torch.inference_mode()
def model_rate(model: torch.nn.Module, batch: torch.Tensor, num_images: int) -> float:
    steps = max(1, num_images // len(batch))
    start = time.perf_counter()
    for _ in range(steps):
        model(batch)
    return steps * len(batch) / (time.perf_counter() - start)


def both_rate(model: torch.nn.Module, dataset: torch.utils.data.Dataset, batch_size: int, workers: int) -> float:
    metrics = evaluate(model, dataset, num_classes=10, batch_size=batch_size, workers=workers, source="bench")
    return float(metrics["images_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the model (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = vitrim.create_model("vit_small_patch16_224", num_classes=10).eval()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp), args.images)
        dataset = build_datasets(str(folder), data_config=model.data_config).test  # type: ignore[arg-type]
        batch = torch.stack([dataset[i][0] for i in range(args.batch_size)])  # type: ignore[index]
        rates: dict[str, list[float]] = {"loader": [], "model": [], "both": []}
        model_rate(model, batch, args.batch_size)  # warm-up
        for _ in range(args.rounds):
            rates["loader"].append(loader_rate(dataset, args.batch_size, args.workers))
            rates["model"].append(model_rate(model, batch, args.images))
            rates["both"].append(both_rate(model, dataset, args.batch_size, args.workers))
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratios = statistics.median(b / m for b, m in zip(rates["both"], rates["model"]))
    print(f"ViT-S/16 at 224, batch {args.batch_size}, {args.workers} workers, {torch.get_num_threads()} torch threads")
    for name, value in median.items():
        print(f"  {name:<6} {value:7.1f} images/s   (rounds: {', '.join(f'{v:.1f}' for v in rates[name])})")
    print(f"  both / model (median of per-round ratios): {ratios:.3f}")


if __name__ == "__main__":
    main()
