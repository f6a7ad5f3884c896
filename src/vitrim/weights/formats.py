"""Reading checkpoint files safely, and converting other formats' keys to vitrim's (= timm's) names.

Formats are recognised by content, never by file name:

* a file's first bytes say how to read it: safetensors (an 8-byte header length, then ``{``), a ``torch.save``
  zip archive (``PK``), or a legacy ``torch.save`` pickle (``0x80``). Anything else is refused with what was found.
* pickles are read with ``torch.load(weights_only=True)``: tensors and plain data only. The only classes allowed
  on top are the harmless ones training scripts store next to the weights (:data:`SAFE_GLOBALS`:
  ``argparse.Namespace``, paths, numpy scalars). A file that would build any other object, and so could run
  code, is refused before anything in it runs.
* the state dict is the file itself, or the dict under ``model`` / ``state_dict`` / ``model_state_dict`` (DeiT
  and DynamicViT releases ship ``{"model": state_dict, ...}``); a ``module.`` prefix (DistributedDataParallel)
  is removed.
* Hugging Face ViT (``vit.encoder.layer.N.attention.attention.query…`` as ``save_pretrained`` writes it, or
  ``vit.layers.N.attention.q_proj…`` as transformers 5 holds it in memory) is converted here: separate
  query/key/value weights are concatenated into timm's fused ``qkv``; the pooler and mask token, which vitrim's
  ViT has no use for, are dropped and reported as ignored.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from vitrim import untrusted
from vitrim.models.eva_names import from_eva_names
from vitrim.weights.hf_names import convert_hf, has_hf_keys

# Harmless classes that training scripts pickle next to the weights; nothing else is unpickled.
SAFE_GLOBALS: list[Any] = [argparse.Namespace, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath]
try:  # numpy scalars (e.g. a best accuracy stored as np.float64); numpy 2 moved the module
    import numpy as np

    _multiarray = getattr(np, "_core", None) or np.core
    SAFE_GLOBALS += [_multiarray.multiarray.scalar, np.dtype]
    SAFE_GLOBALS += [type(np.dtype(name)) for name in ("float64", "float32", "int64", "int32", "bool")]
except (ImportError, AttributeError):  # pragma: no cover - numpy is a dependency
    pass

NESTED_STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict")
# weight files in the order transformers and timm look for them; an index names the shards of a sharded save
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass
class RawCheckpoint:
    """What a checkpoint path holds: its tensors (names as stored), and whatever describes the model.

    metadata: safetensors metadata (vitrim writes ``vitrim.class``, ``vitrim.config``); hf_config: the parsed
    ``config.json`` next to Hugging Face weights, or None.
    """

    path: Path
    state_dict: dict[str, Tensor]
    metadata: dict[str, str] = field(default_factory=dict)
    hf_config: dict[str, Any] | None = None
    _in_vitrim_names: tuple[dict[str, Tensor], list[str]] | None = field(default=None, init=False, repr=False)

    def hf_in_vitrim_names(self) -> tuple[dict[str, Tensor], list[str]]:
        """Hugging Face tensors under vitrim's names, and the keys dropped (:func:`convert_hf`), converted once per
        checkpoint however many steps of a load read them (the config's fields, then the load itself)."""
        if self._in_vitrim_names is None:
            self._in_vitrim_names = convert_hf(self.state_dict)
        return self._in_vitrim_names


def check_path(path: object, name: str = "path") -> Path:
    """``str`` / ``os.PathLike`` -> an existing Path; a clear TypeError or FileNotFoundError otherwise."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(path).__name__}")
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"checkpoint not found: {str(resolved)!r}")
    return resolved


def read_checkpoint(path: str | os.PathLike[str]) -> RawCheckpoint:
    """Read a checkpoint file, or a Hugging Face ``save_pretrained`` directory, without running any code."""
    source = check_path(path)
    if source.is_dir():
        return _read_hf_directory(source)
    state_dict, metadata = read_weights_file(source)
    config_file = source.parent / "config.json"
    hf_config = None
    if has_hf_keys(state_dict) and config_file.is_file():
        hf_config = read_json(config_file)
    return RawCheckpoint(source, state_dict, metadata, hf_config)


def _read_hf_directory(directory: Path) -> RawCheckpoint:
    weights = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if weights is None:
        found = sorted(p.name for p in directory.iterdir())[:10]
        raise ValueError(
            f"directory {str(directory)!r} is not a checkpoint: expected one of {list(WEIGHT_FILES)}, found {found}"
        )
    if weights.name.endswith(".index.json"):
        state_dict: dict[str, Tensor] = {}
        for shard in shard_files(weights):
            state_dict.update(read_weights_file(check_path(directory / shard))[0])
    else:
        state_dict = read_weights_file(weights)[0]
    config_file = directory / "config.json"
    hf_config = read_json(config_file) if config_file.is_file() else None
    return RawCheckpoint(weights, state_dict, {}, hf_config)


def shard_files(index: Path) -> list[str]:
    """The shard files a sharded save's index (``*.index.json``) names, in order: its ``weight_map`` maps every
    tensor name to the shard that holds it."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{str(index)!r} has no 'weight_map'; not a Hugging Face shard index")
    return sorted({shard_name(name, index) for name in weight_map.values()})


def shard_name(name: object, index: Path) -> str:
    """A shard index's file name: a plain name beside the index, never a path that leads elsewhere."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"{str(index)!r}: weight_map names shard {name!r:.80}; expected a file name beside the index")
    return name


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file from outside (:mod:`vitrim.untrusted`: size, depth, non-finite numbers)."""
    return untrusted.expect_object(untrusted.read_json(path), str(path))


def sniff(path: Path) -> str:
    """'safetensors', 'zip' or 'pickle' from the first bytes; ValueError saying what was found otherwise."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(9)
    if len(head) == 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if 0 < header_len <= size - 8 and head[8:9] == b"{":
            return "safetensors"
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head.startswith(b"\x80"):
        return "pickle"
    raise ValueError(
        f"{str(path)!r} is not a checkpoint: found {_describe(path, size)}; expected safetensors or a torch.save file"
    )


def _describe(path: Path, size: int) -> str:
    if size == 0:
        return "an empty file"
    with path.open("rb") as f:
        head = f.read(64)
    if head.startswith(b"\x1f\x8b"):
        return "a gzip archive"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"{size} bytes of unknown binary data starting {head[:8].hex(' ')}"
    first_line = text.strip().splitlines()[0][:40] if text.strip() else ""
    return f"a text file starting {first_line!r}"


def read_weights_file(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """One file -> (state dict with the names as stored, safetensors metadata or {})."""
    kind = sniff(path)
    try:
        if kind == "safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = dict(f.metadata() or {})
                return {key: f.get_tensor(key) for key in f.keys()}, metadata  # noqa: SIM118 (safe_open is no dict)
        loaded = _torch_load(path)
    except ValueError:
        raise  # ours: already names the file and what was found
    except Exception as err:  # a truncated or corrupted file raises anything from safetensors, zipfile or pickle
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{str(path)!r} is truncated or corrupt: it starts like a {kind} file but {detail}") from None
    return find_state_dict(loaded, path), {}


def _torch_load(path: Path) -> Any:
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    try:
        if safe_globals is None:  # pragma: no cover - torch < 2.5: the allow-list is process-wide there
            torch.serialization.add_safe_globals(SAFE_GLOBALS)
            return torch.load(path, map_location="cpu", weights_only=True)
        with safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "Unsupported" in line), str(err)[:200])
        raise ValueError(
            f"refusing to load {str(path)!r}: it stores Python objects that could run code when unpickled "
            f"({detail}). vitrim reads tensors and plain data only (torch.load weights_only=True); if you trust "
            "the file, re-save its state dict with safetensors.torch.save_file"
        ) from None
    except RuntimeError as err:
        raise ValueError(f"{str(path)!r} could not be read as a torch.save file: {str(err).splitlines()[0]}") from None


def _is_state_dict(value: object) -> bool:
    return (
        isinstance(value, dict)
        and len(value) > 0
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in value.items())
    )


def find_state_dict(obj: object, path: Path) -> dict[str, Tensor]:
    """The state dict inside what ``torch.load`` returned: itself, or under ``model`` / ``state_dict``."""
    if _is_state_dict(obj):
        state_dict = dict(obj)  # type: ignore[call-overload]
    else:
        nested = [obj[key] for key in NESTED_STATE_DICT_KEYS if isinstance(obj, dict) and _is_state_dict(obj.get(key))]
        if not nested:
            if isinstance(obj, dict):
                found = f"a dict with keys {sorted(map(str, obj))[:10]}"
            else:
                found = f"a {type(obj).__name__}"
            raise ValueError(
                f"{str(path)!r} holds no state dict: found {found}; expected a dict of tensors, "
                f"or one under {list(NESTED_STATE_DICT_KEYS)}"
            )
        state_dict = dict(nested[0])
    if all(key.startswith("module.") for key in state_dict):  # saved from DistributedDataParallel
        state_dict = {key.removeprefix("module."): value for key, value in state_dict.items()}
    return state_dict


def convert_timm(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """timm's names -> vitrim's: its ViT names pass through, its Eva names are converted
    (:func:`vitrim.models.eva_names.from_eva_names`)."""
    return from_eva_names(state_dict)


def detect_format(raw: RawCheckpoint) -> str:
    """'vitrim', 'huggingface', 'dynamicvit' (timm names + score predictors) or 'timm' (timm / DeiT / EVA names)."""
    if "vitrim.class" in raw.metadata:
        return "vitrim"
    if has_hf_keys(raw.state_dict):
        return "huggingface"
    if any(key.startswith("score_predictor.") for key in raw.state_dict):
        return "dynamicvit"
    return "timm"
