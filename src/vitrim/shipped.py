"""The demos' trained weights, shipped in the package, so that a first ``make demo`` evaluates instead of training.

``vitrim demo`` and ``vitrim demo translate`` copy a shipped run into their run folder, then evaluate, time and draw
it exactly as they would a run they had just trained; ``--retrain`` runs the recipe that made these files, from
scratch. After a recipe changes, ``make demo-weights`` retrains both demos and copies their files back here
(``--ship-to``), and ``tests/train/test_demo_shipped.py`` checks that the shipped files still are what the recipe
makes.

Layout (``src/vitrim/data/demo/``), the same as the run folders, so that shipping and installing are plain copies:

    vision/summary.json                       the training run's summary (top-1 when trained, training seconds)
    vision/<model>/last.safetensors, run.json one per demo model (dense, dynamicvit, dense_reg, dynamicvit_reg, cnn)
    translate/model.safetensors, vocab.json, summary.json
    vlm/model.safetensors, config.json, summary.json, details.json   the digits LLaVA (vitrim.demos.vlm)
    video/model.safetensors, config.json, summary.json, details.json the digits Qwen2-VL (vitrim.demos.video)

Only safetensors and JSON are shipped: nothing in them can run code (:mod:`vitrim.weights.checkpoint`). Weights are
stored as float16 (3 MB instead of 6; the demos' top-1 and exact match are the same as with the float32 weights they
were trained to, which ``summary.json`` records and the report compares).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vitrim.atomic import atomic_write

SHIPPED = Path(__file__).resolve().parent / "data" / "demo"


def shipped_run(kind: str) -> Path:
    """The folder of a shipped run: ``kind`` is ``"vision"`` (``vitrim demo``), ``"translate"``, ``"vlm"`` or
    ``"video"``."""
    if kind not in ("vision", "translate", "vlm", "video"):
        raise ValueError(f"kind must be 'vision', 'translate', 'vlm' or 'video', got {kind!r}")
    folder = SHIPPED / kind
    if not (folder / "summary.json").is_file():
        raise FileNotFoundError(
            f"this installation of vitrim has no shipped demo weights ({str(folder)!r} is missing); "
            "train them with --retrain"
        )
    return folder


def copy_run_files(source: Path, dest: Path, files: Iterable[str], *, float16: bool = False) -> None:
    """Copy ``files`` (paths relative to the run folders) from ``source`` to ``dest``, each whole or not at all.

    Every file is checked before the first is copied, so a run folder missing one leaves ``dest`` untouched. With
    ``float16`` the float32 tensors of ``.safetensors`` files are stored as float16 (half the size; loading casts
    them back into the model's float32 parameters).
    """
    files = list(files)
    missing = [f for f in files if not (source / f).is_file()]
    if missing:
        raise FileNotFoundError(f"run folder {str(source)!r} has no {', '.join(missing)}")
    for f in files:
        halve = float16 and f.endswith(".safetensors")
        atomic_write(dest / f, partial(_copy_float16 if halve else _copy, source / f))


def _copy(original: Path, tmp: Path) -> None:
    shutil.copyfile(original, tmp)


def _copy_float16(original: Path, tmp: Path) -> None:
    with safe_open(original, framework="pt") as f:
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    halved = {key: t.half() if t.dtype == torch.float32 else t for key, t in tensors.items()}
    save_file(halved, str(tmp), metadata=metadata)
