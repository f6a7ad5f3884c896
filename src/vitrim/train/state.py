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
from vitrim.untrusted import expect_object, read_json
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
    """The ``run.json`` next to a checkpoint, its shape checked (:func:`check_run_record`), or {} when there is none.

    Its ``data`` / ``val_data`` are checked where they are used instead of the user's own
    (:func:`vitrim.train.checkpoint_eval.load_checkpoint_split`): a user who gives ``--data`` never needs them.
    """
    path = Path(checkpoint).parent / RUN_RECORD
    return check_run_record(read_json(path), str(path)) if path.is_file() else {}


# what a run record may say, field by field: (types, what the error says was expected); a checkpoint and its run.json
# come from anyone, so each value is checked before it reaches a dataset, a model or a shell-free path check
_RUN_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "a model name"),
    "overrides": ((dict,), "an object of create_model keyword arguments"),
    "set": ((dict,), "an object of create_model keyword arguments"),
    "data_config": ((dict,), "an object of data-config fields"),
    "classes": ((list,), "a list of class names"),
    "data": ((str,), "'digits', a folder or a shard pattern"),
    "val_data": ((str, type(None)), "a folder, a shard pattern or null"),
    "seed": ((int,), "an int"),
    "test_fraction": ((int, float), "a number in (0, 1)"),
    "clutter": ((int,), "an int >= 0"),
    "noise": ((int, float), "a number >= 0"),
    "align": ((int,), "an int >= 1"),
}


def check_run_record(record: Any, source: str) -> dict[str, Any]:
    """``record`` (a run's settings read from ``source``) if every field it has is of its documented shape, else one
    ValueError naming the file, the field, the value and what was expected.

    ``data`` / ``val_data`` are checked where a record's value is opened instead of the user's own
    (:func:`vitrim.train.checkpoint_eval.load_checkpoint_split`, with :func:`vitrim.data.shards.check_local`: a
    ``pipe:`` or URL pattern in a file is refused, never opened); a resume only compares them with what the user typed.
    """
    record = expect_object(record, source)
    for name, (types, expected) in _RUN_FIELDS.items():
        if name not in record:
            continue
        value = record[name]
        bad_type = not isinstance(value, types) or isinstance(value, bool)
        if bad_type or not _in_range(name, value):
            raise ValueError(f"{source}: {name!r} must be {expected}, got {_short(value)}")
    return record


def _in_range(name: str, value: Any) -> bool:
    if name == "seed":
        return 0 <= value < 2**63
    if name == "test_fraction":
        return 0 < value < 1
    if name in ("clutter", "noise"):
        return 0 <= value < 10**6
    if name == "align":
        return 1 <= value < 10**6
    if name == "classes":
        return all(isinstance(c, str) for c in value)
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        run = check_run_record(state.get("run", {}), f"{str(path)!r}'s run settings")
        if "model" not in run:
            raise ValueError(f"{str(path)!r} does not record which model it trained")
        overrides = dict(run.get("overrides", {}))
        model = create_model(run["model"], **overrides)
        model.load_state_dict(state["model"], strict=True)
        return model.eval(), run
    return load_model(path), read_run_record(path)
