"""Bounded before allocated: what a model config read from a file may ask for.

A config read from a file (a checkpoint's ``vitrim.config`` metadata, a hub repo's ``config.json`` in timm's or
transformers' layout) says how big a model to build; the file's tensors say how big a model it justifies. Every
loader checks both before it makes a single tensor:

* :func:`check_file_config`: each size field is an int (not a bool, not a string), each number finite, no size zero
  where a division follows, and none above :data:`LIMITS` (far above any published model: ViT-22B has width 6144,
  depth 48, 48 heads). The error names the field, its value and the limit.
* :func:`check_fits_weights`: the model is built on PyTorch's ``meta`` device (shapes only, no memory), and the
  values it would hold (parameters and buffers) may exceed the values the file holds by at most
  :data:`MAX_FRESH_VALUES` (a fresh classifier head, register tokens the weights lack). A config of
  ``num_classes: 10**9`` beside 60 KB of weights is refused here, however its fields sit within the limits.

The limits are module-level (:data:`LIMITS`, :data:`MAX_FRESH_VALUES`); to load a bigger model from a file you
trust, raise them for that load only::

    with raised_limits(embed_dim=32768, max_fresh_values=2**28):
        model = vitrim.load_model("big.safetensors")

What the user passes in Python (``create_model(..., embed_dim=...)``, ``load_model(path, img_size=...)``) is the
user's choice and is not bounded here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

_WIDTH, _DEPTH, _HEADS, _SIDE = 16384, 256, 256, 8192
# field -> largest value a file may ask for; vitrim's (timm's) names, transformers' names and Seq2Seq's
LIMITS: dict[str, int] = {
    "embed_dim": _WIDTH,
    "hidden_size": _WIDTH,
    "dim": _WIDTH,
    "intermediate_size": 16 * _WIDTH,
    "depth": _DEPTH,
    "num_hidden_layers": _DEPTH,
    "encoder_depth": _DEPTH,
    "decoder_depth": _DEPTH,
    "num_heads": _HEADS,
    "num_attention_heads": _HEADS,
    "num_key_value_heads": _HEADS,
    "head_dim": _WIDTH,
    "max_position_embeddings": 2**20,
    "vocab_size": 2**20,
    "num_classes": 2**20,
    "src_vocab_size": 2**20,
    "tgt_vocab_size": 2**20,
    "max_len": 2**16,
    "img_size": _SIDE,
    "image_size": _SIDE,
    "patch_size": 1024,
    "in_chans": 1024,
    "num_channels": 1024,
    "reg_tokens": 256,
    "num_register_tokens": 256,
    "groups": _WIDTH,
    "widths": _WIDTH,
    "mlp_ratio": 64,
    "num_patches": 2**16,  # (img_size / patch_size)^2: the tokens of one image, whose attention is (N, N)
}
POSITIVE = frozenset(
    {"embed_dim", "hidden_size", "dim", "intermediate_size", "depth", "num_hidden_layers", "encoder_depth"}
    | {"decoder_depth", "num_heads", "num_attention_heads", "src_vocab_size", "tgt_vocab_size", "max_len"}
    | {"img_size", "image_size", "patch_size", "in_chans", "num_channels", "groups", "widths"}
    | {"num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size"}
)
# numbers that must be finite, and where they must lie: (low, high, low included)
RANGES: dict[str, tuple[float, float, bool]] = {
    "mlp_ratio": (0.0, LIMITS["mlp_ratio"], False),
    "norm_eps": (0.0, 1.0, False),
    "layer_norm_eps": (0.0, 1.0, False),
    "rms_norm_eps": (0.0, 1.0, False),
    "drop_rate": (0.0, 1.0, True),
    "attn_drop_rate": (0.0, 1.0, True),
    "drop_path_rate": (0.0, 1.0, True),
    "dropout": (0.0, 1.0, True),
    "hidden_dropout_prob": (0.0, 1.0, True),
    "attention_probs_dropout_prob": (0.0, 1.0, True),
    "attention_dropout": (0.0, 1.0, True),
    "init_values": (-1e6, 1e6, True),
    "layerscale_value": (-1e6, 1e6, True),
    "rope_temperature": (0.0, 1e12, False),
}
# switches a file must state as JSON true/false (``class_token: -5`` would count -5 prefix tokens); None: timm's default
FLAGS = frozenset(
    {"qkv_bias", "qk_norm", "class_token", "distilled", "no_embed_class", "pre_norm", "fc_norm", "swiglu_mlp"}
    | {"scale_mlp", "use_rot_pos_emb", "pos_embed_antialias"}
)
FLAGS_MAY_BE_NULL = frozenset({"fc_norm"})
MAX_FRESH_VALUES = 2**24  # values a model may hold beyond its file's (64 MiB in float32): a fresh head, registers


@contextmanager
def raised_limits(*, max_fresh_values: int | None = None, **limits: int) -> Iterator[None]:
    """Within the ``with`` block, the named :data:`LIMITS` (and :data:`MAX_FRESH_VALUES`) are the values given."""
    global MAX_FRESH_VALUES
    unknown = sorted(set(limits) - set(LIMITS))
    if unknown:
        raise ValueError(f"raised_limits: unknown limit(s) {unknown}; known: {sorted(LIMITS)}")
    saved, saved_fresh = dict(LIMITS), MAX_FRESH_VALUES
    LIMITS.update(limits)
    MAX_FRESH_VALUES = saved_fresh if max_fresh_values is None else max_fresh_values
    try:
        yield
    finally:
        LIMITS.clear()
        LIMITS.update(saved)
        MAX_FRESH_VALUES = saved_fresh


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


FROM_A_FILE = (
    "for a config read from a file (raise it for a file you trust with vitrim.models.config_limits.raised_limits)"
)
FROM_THE_COMMAND_LINE = "for a model built from the command line (vitrim.models.config_limits.LIMITS)"


def _check_size(name: str, value: Any, source: str, origin: str = FROM_A_FILE) -> None:
    sizes = value if isinstance(value, (list, tuple)) and name in ("img_size", "image_size", "widths") else [value]
    if name in ("img_size", "image_size") and isinstance(value, (list, tuple)) and len(value) != 2:
        raise ValueError(f"{source}: {name} must be an int or a pair of ints, got {value!r:.80}")
    if name == "widths" and len(sizes) > _DEPTH:
        raise ValueError(f"{source}: widths has {len(sizes)} stages, over the limit of {_DEPTH}")
    low = 1 if name in POSITIVE else 0
    for size in sizes:
        if not _is_int(size):
            raise ValueError(f"{source}: {name} must be an int, got {value!r:.80}")
        if size < low:
            raise ValueError(f"{source}: {name} must be >= {low}, got {value!r:.80}")
        if size > LIMITS[name]:
            raise ValueError(f"{source}: {name} = {size} is over the limit of {LIMITS[name]} {origin}")


def _check_number(name: str, value: Any, source: str) -> None:
    if value is None and name in ("init_values",):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{source}: {name} must be a number, got {value!r:.80}")
    low, high, low_included = RANGES[name]
    if not (math.isfinite(value) and (low <= value if low_included else low < value) and value <= high):
        bracket = "[" if low_included else "("
        raise ValueError(f"{source}: {name} must be a finite number in {bracket}{low:g}, {high:g}], got {value!r}")


def check_file_config(fields: Mapping[str, Any], source: str, *, origin: str = FROM_A_FILE) -> None:
    """Every size and number in ``fields`` (a config read from ``source``) typed, finite and within the limits
    (module doc); ``ValueError`` naming ``source``, the field, its value and the limit. Unknown fields pass (the
    config class refuses them). ``origin`` ends the over-the-limit message (:data:`FROM_THE_COMMAND_LINE`: the
    sizes a command's ``--set`` asks for, bounded like a file's)."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"{source}: expected a JSON object of config fields, got {type(fields).__name__}")
    for name, value in fields.items():
        if name in LIMITS and name != "mlp_ratio" and name != "num_patches":
            _check_size(name, value, source, origin)
        elif name in RANGES:
            _check_number(name, value, source)
        elif name in FLAGS and not (isinstance(value, bool) or (value is None and name in FLAGS_MAY_BE_NULL)):
            raise ValueError(f"{source}: {name} must be true or false, got {value!r:.80}")
    for size_name, patch_name in (("img_size", "patch_size"), ("image_size", "patch_size")):
        size, patch = fields.get(size_name), fields.get(patch_name)
        if size is None or not _is_int(patch):
            continue
        h, w = (size, size) if _is_int(size) else size
        if h % patch or w % patch:
            raise ValueError(f"{source}: {size_name} {size!r} is not divisible by {patch_name} {patch}")
        if (h // patch) * (w // patch) > LIMITS["num_patches"]:
            raise ValueError(
                f"{source}: {size_name} {size!r} with {patch_name} {patch} makes {(h // patch) * (w // patch)} "
                f"patches, over the limit of {LIMITS['num_patches']}"
            )


def count_values(build: Callable[[], nn.Module]) -> tuple[int, str, tuple[int, ...]]:
    """(values held by the model ``build()`` makes, its largest tensor's name and shape), built on the ``meta``
    device: shapes only, no memory, no initialisation."""
    with torch.device("meta"):
        model = build()
    total, largest = 0, ""
    shape: tuple[int, ...] = ()
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        total += tensor.numel()
        if not shape or tensor.numel() > math.prod(shape):
            largest, shape = name, tuple(tensor.shape)
    return total, largest, shape


def check_fits_weights(build: Callable[[], nn.Module], weights: Mapping[str, Tensor], source: str) -> None:
    """Refuse the model ``build()`` makes when it would hold more than ``weights`` justify (module doc)."""
    held = sum(tensor.numel() for tensor in weights.values())
    needed, largest, shape = count_values(build)
    if needed > held + MAX_FRESH_VALUES:
        raise ValueError(
            f"{source}: its config describes a model of {needed:,} values (largest: {largest} {list(shape)}), but "
            f"the file holds {held:,}; a config may ask for at most {MAX_FRESH_VALUES:,} values its weights lack "
            "(vitrim.models.config_limits.raised_limits(max_fresh_values=...) raises it)"
        )


def check_file_model(
    fields: Mapping[str, Any], build: Callable[[], nn.Module], weights: Mapping[str, Tensor], source: str
) -> None:
    """:func:`check_file_config` then :func:`check_fits_weights`: the one call every loader makes."""
    check_file_config(fields, source)
    check_fits_weights(build, weights, source)
