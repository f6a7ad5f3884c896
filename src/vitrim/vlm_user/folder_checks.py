"""What a checkpoint folder from a stranger must satisfy before transformers builds anything from it.

:func:`check_folder` reads every file ``vitrim vlm ask --model`` will hand transformers as data first, so a hostile
folder ends in one ``ValueError`` naming ``--model``, the file, the field and the value (never a traceback, never an
error in a library's words, never minutes of building):

* every ``*.json`` (config, tokenizer, processor, generation) through :mod:`vitrim.untrusted` (size, depth, NaN);
* ``config.json`` and each config nested in it through :mod:`vitrim.models.config_limits` (sizes typed, positive
  and bounded), its ``dtype`` a floating torch dtype, its ``vision_feature_layer`` a layer the tower has and its
  image / video token ids inside the vocabulary (values that would otherwise fail only at the forward);
* every ``*.safetensors`` header read by hand (offsets inside the file, the data filling it exactly), so a link to
  another file or a truncated shard is named; the values the config describes (counted on the ``meta`` device) may
  exceed those the weights hold by at most ``config_limits.MAX_FRESH_VALUES``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitrim.models import config_limits
from vitrim.untrusted import MAX_JSON_BYTES, expect_object, parse_json, read_json

TOKEN_ID_FIELDS: tuple[str, ...] = ("image_token_index", "image_token_id", "video_token_index", "video_token_id")
TOKEN_ID_FIELDS += ("boi_token_index", "eoi_token_index", "vision_start_token_id", "vision_end_token_id")
DTYPE_FIELDS = ("dtype", "torch_dtype")


def check_folder(folder: Path, name: str) -> dict[str, Any]:
    """Check ``folder`` (module doc); ``name`` starts every error (``--model X``). Returns its config.json."""
    for path in sorted(folder.glob("*.json")):
        read_json(path, f"{name}: {path.name}")
    config = expect_object(read_json(folder / "config.json", f"{name}: config.json"), f"{name}: config.json")
    check_config(config, f"{name}: config.json")
    for path in sorted(folder.glob("*.safetensors")):
        safetensors_values(path, f"{name}: {path.name}")
    return config


def check_config(config: Mapping[str, Any], source: str) -> None:
    """The fields of a transformers VLM config (and of each config nested in it) typed, bounded and consistent."""
    _check_fields(config, source)
    text: Mapping[str, Any] = config["text_config"] if isinstance(config.get("text_config"), Mapping) else config
    vision = config.get("vision_config")
    vocab = text.get("vocab_size", config.get("vocab_size"))
    for field in TOKEN_ID_FIELDS:
        value = config.get(field)
        if value is None:
            continue
        if not config_limits._is_int(value) or value < 0:
            raise ValueError(f"{source}: {field} must be a token id (an int >= 0), got {value!r:.80}")
        if config_limits._is_int(vocab) and value >= vocab:
            raise ValueError(f"{source}: {field} = {value} is not a token of the vocabulary (vocab_size {vocab})")
    layers: Any = vision.get("num_hidden_layers", vision.get("depth")) if isinstance(vision, Mapping) else None
    chosen = config.get("vision_feature_layer")
    if chosen is not None and config_limits._is_int(layers):
        for layer in chosen if isinstance(chosen, list) else [chosen]:
            # hidden_states holds the embeddings and each layer's output: layers + 1 entries, indexed from either end
            if not config_limits._is_int(layer) or not -(layers + 1) <= layer <= layers:
                raise ValueError(
                    f"{source}: vision_feature_layer {chosen!r:.80} names no layer of the {layers}-layer tower "
                    f"(expected an int in [{-(layers + 1)}, {layers}])"
                )


def _check_fields(config: Mapping[str, Any], source: str) -> None:
    import torch

    config_limits.check_file_config(config, source)
    for field in DTYPE_FIELDS:
        value = config.get(field)
        if value is None or value == "auto":
            continue
        dtype = getattr(torch, value, None) if isinstance(value, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{source}: {field} {value!r:.80} is not a floating-point torch dtype (e.g. bfloat16)")
    for key, value in config.items():
        if isinstance(value, Mapping) and key.endswith("_config"):
            _check_fields(value, f"{source} {key}")


def safetensors_values(path: Path, source: str) -> int:
    """The number of values a ``.safetensors`` file holds, its header read as untrusted data: an 8-byte length, a
    JSON object of ``{name: {dtype, shape, data_offsets}}``, then the data, which the offsets must tile exactly."""
    size = path.stat().st_size
    with path.open("rb") as file:
        head = file.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= length <= min(MAX_JSON_BYTES, size - 8):
            raise ValueError(f"{source}: not a safetensors file (its {size}-byte content has no safetensors header)")
        header = expect_object(parse_json(file.read(length), source), source)
    held, end = 0, 0
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, Mapping) else None
        offsets = entry.get("data_offsets") if isinstance(entry, Mapping) else None
        if not (isinstance(shape, list) and all(config_limits._is_int(s) and s >= 0 for s in shape)) or not (
            isinstance(offsets, list) and len(offsets) == 2 and all(config_limits._is_int(o) for o in offsets)
        ):
            raise ValueError(f"{source}: tensor {tensor!r:.60} has no valid shape and data_offsets")
        held += math.prod(shape)
        end = max(end, offsets[1])
    if end != size - 8 - length:
        raise ValueError(f"{source}: its header describes {end} bytes of data, the file holds {size - 8 - length}")
    return held


def check_fits_weights(config: Any, folder: Path, name: str) -> None:
    """The model ``config`` describes, built on the ``meta`` device, holds at most ``MAX_FRESH_VALUES`` values more
    than the folder's safetensors files: a config may not ask for a model its weights do not justify."""
    import transformers

    held = sum(safetensors_values(path, f"{name}: {path.name}") for path in folder.glob("*.safetensors"))
    needed, largest, shape = config_limits.count_values(
        lambda: transformers.AutoModelForImageTextToText.from_config(config)
    )
    if needed > held + config_limits.MAX_FRESH_VALUES:
        raise ValueError(
            f"{name}: config.json describes a model of {needed:,} values (largest: {largest} {list(shape)}), but its "
            f"weights hold {held:,}; a config may ask for at most {config_limits.MAX_FRESH_VALUES:,} values its "
            "weights lack (vitrim.models.config_limits.raised_limits(max_fresh_values=...) raises it)"
        )
