"""Run state on disk: atomic writes, the resume file, model weights with what it takes to rebuild the model.

A run folder holds:

* ``last.pt``: everything to resume (model, optimiser, scheduler, next epoch, best top-1, RNG states, the run's
  settings). Plain tensors and Python containers only, read back with ``torch.load(weights_only=True)``.
* ``last.safetensors`` and ``best.safetensors``: model weights written by :func:`vitrim.weights.save_checkpoint`
  (model class and config in the metadata: ``vitrim.load_model`` rebuilds the model).
* ``run.json``: the run's settings (model name, overrides, class names, data options), for ``vitrim eval``.

Every file is written to a temporary name in the same folder, flushed to disk, then renamed over the old one with
``os.replace`` (atomic on POSIX): a crash mid-write leaves the previous file whole.
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrim.atomic import atomic_write
from vitrim.factory import create_model
from vitrim.weights.checkpoint import build_saved_model
from vitrim.weights.hub import is_hub_name
from vitrim.weights.pretrained import load_model

RUN_RECORD = "run.json"


def capture_rng() -> dict[str, Any]:
    """The torch (CPU and CUDA) and Python ``random`` states; numpy's global RNG is not used by training."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(path: str | Path, state: dict[str, Any]) -> Path:
    """Write the resume file atomically (``torch.save`` of tensors and plain containers)."""
    return atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_training_state(path: str | Path) -> dict[str, Any]:
    """Read a resume file; never executes code (``weights_only=True``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no training state at {str(path)!r}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "Unsupported" in line), "")
        raise ValueError(
            f"refusing to load {str(path)!r}: it stores Python objects that could run code when unpickled "
            f"(torch.load weights_only=True; {detail or 'not a plain training state'})"
        ) from None
    except Exception as err:  # a truncated or corrupted file raises anything from zipfile or pickle
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(
            f"{str(path)!r} is truncated or corrupt ({detail}); nothing was changed in {str(path.parent)!r}: "
            "restore the file, or start a new run in another --out"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise ValueError(f"{str(path)!r} is not a vitrim training state (no 'model' / 'epoch' entries)")
    return state


def write_run_record(out: str | Path, record: dict[str, Any]) -> Path:
    """``run.json``: the settings of a run (model name, overrides, classes, data), read by ``vitrim eval``."""
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"

    def write(tmp: Path) -> None:
        tmp.write_text(text)

    return atomic_write(Path(out) / RUN_RECORD, write)


def read_run_record(checkpoint: str | Path) -> dict[str, Any]:
    """The ``run.json`` next to a checkpoint, or {} when there is none (a checkpoint from elsewhere)."""
    path = Path(checkpoint).parent / RUN_RECORD
    return json.loads(path.read_text()) if path.is_file() else {}


def load_for_eval(checkpoint: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a trained model and load its weights: (model in eval mode, its run record or {}).

    ``.safetensors`` written by :func:`vitrim.weights.save_checkpoint` rebuild from their metadata; a resume
    file (``last.pt``) rebuilds from the run settings stored in it; a hub name (``"hf-hub:ORG/NAME"``) is
    :func:`vitrim.load_model`'s, with no run record.
    """
    if is_hub_name(checkpoint):
        return load_model(str(checkpoint)), {}
    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.suffix == ".pt":
        state = load_training_state(path)
        run = dict(state.get("run", {}))
        if "model" not in run:
            raise ValueError(f"{str(path)!r} does not record which model it trained")
        overrides = dict(run.get("overrides", {}))
        model = create_model(run["model"], **overrides)
        model.load_state_dict(state["model"], strict=True)
        return model.eval(), run
    return build_saved_model(path), read_run_record(path)
