"""Peak memory of ``vitrim eval`` over image folders of growing size: streamed data keeps it flat.

    PYTHONPATH=src python benchmarks/data_memory.py --sizes 2000 20000 --workers 2 --json runs/data_memory.json

For each size N it writes an ImageNet-layout folder (``val/<class>/<i>.png``: N tiny 8x8 PNGs over 10 classes, and
one image per class under ``train/``), a tiny ViT checkpoint for 8x8 images, and runs ``vitrim eval`` on ``val/`` in
a fresh process. It reports that process's peak resident memory (``ru_maxrss``) and the largest of its DataLoader
workers', with images/s. Held whole, 20,000 decoded 8x8 images would take 3.7 MiB (ImageNet's 1.28 M at 224: 180 GiB);
the file list is what grows here. tests/datasets/test_folder_memory.py runs it (200 vs 2,000 by default, 2,000 vs
20,000 in the full run).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CLASSES = 10
RUNNER = """
import json, resource, sys, torch
from vitrim.cli import main
torch.set_num_threads(1)
code = main(["eval", sys.argv[1], "--data", sys.argv[2], "--workers", sys.argv[3], "--batch-size", sys.argv[4],
             "--json", sys.argv[5], "--quiet"])
own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"code": code, "main_kib": own.ru_maxrss, "worker_kib": workers.ru_maxrss}))
"""


def _png(value: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (value, 255 - value, (7 * value) % 256)).save(buffer, format="PNG")
    return buffer.getvalue()


def make_folder(root: Path, num_images: int) -> Path:
    """``root/train/<class>/0.png`` and ``root/val/<class>/<i>.png``, ``num_images`` under val/."""
    pictures = [_png(25 * k) for k in range(CLASSES)]
    for k in range(CLASSES):
        (root / "train" / f"class_{k}").mkdir(parents=True, exist_ok=True)
        (root / "train" / f"class_{k}" / "0.png").write_bytes(pictures[k])
        (root / "val" / f"class_{k}").mkdir(parents=True, exist_ok=True)
    for i in range(num_images):
        (root / "val" / f"class_{i % CLASSES}" / f"{i:07d}.png").write_bytes(pictures[i % CLASSES])
    return root


def make_checkpoint(path: Path) -> Path:
    import vitrim

    model = vitrim.create_model(
        "vit_tiny_patch16_224", num_classes=CLASSES, img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2
    )
    vitrim.save_checkpoint(model, path)
    return path


def measure(checkpoint: Path, folder: Path, *, workers: int, batch_size: int, report: Path) -> dict:
    """Run ``vitrim eval`` in a fresh process; its peak memory, its workers' and its images/s."""
    args = [str(checkpoint), str(folder), str(workers), str(batch_size), str(report)]
    done = subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vitrim eval failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    memory = json.loads(done.stdout.strip().splitlines()[-1])
    metrics = json.loads(report.read_text())
    return {
        "images": metrics["num_samples"],
        "main_mib": memory["main_kib"] / 1024,
        "worker_mib": memory["worker_kib"] / 1024,
        "images_per_s": metrics["images_per_s"],
        "code": memory["code"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", dest="json_path", help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint(Path(tmp) / "tiny.safetensors")
        for size in args.sizes:
            folder = make_folder(Path(tmp) / f"folder_{size}", size)
            row = measure(checkpoint, folder, workers=args.workers, batch_size=args.batch_size, report=Path(tmp) / "m")
            rows.append({"size": size, **row})
            print(
                f"{size:>7} images: vitrim eval peak RSS {row['main_mib']:.1f} MiB, largest worker "
                f"{row['worker_mib']:.1f} MiB, {row['images_per_s']:.0f} images/s",
                flush=True,
            )
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
