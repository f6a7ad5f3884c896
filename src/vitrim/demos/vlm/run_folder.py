"""A digits VLM run folder read as files from someone else: ``vitrim vlm ask --run DIR``, ``vitrim viz vlm --run DIR``.

A run folder (``config.json`` and ``model.safetensors``, :mod:`vitrim.demos.vlm.model`) may come from anywhere, so it
is read as every checkpoint is, and each problem ends in one ``ValueError`` naming the file, the field and its value:

* ``config.json`` through :mod:`vitrim.untrusted` (size, nesting depth, no ``NaN``/``Infinity``), its sizes through
  :func:`vitrim.models.config_limits.check_file_config` (ints, finite numbers, limits: ``rms_norm_eps`` in (0, 1]);
* the fields the demo's data, vocabulary and processor fix (:data:`FIXED`: 28 words, the image token, a 64×64 canvas
  of 8×8 patches read at LLaVA's layer -2 without [CLS]) must say so: the same model with other sizes is fine, another
  model is not;
* the weights through vitrim's checkpoint reader (a truncated or corrupt file is one line), then the model the config
  describes is built on the ``meta`` device (shapes only) and refused when it would hold more values than the file
  (:func:`~vitrim.models.config_limits.check_fits_weights`) or any tensor's name, shape or dtype differs, before a
  single real tensor is made; non-finite weights are refused;
* last, the model answers one blank canvas: a config that builds but cannot run (an activation transformers does not
  know, an ``rms_norm_eps`` that makes NaN of every row) is refused here rather than answering nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from vitrim import untrusted
from vitrim.demos.vlm.data import CANVAS, PATCH
from vitrim.demos.vlm.model import CONFIG_FILE, MODEL_FILE, build_model, import_transformers
from vitrim.demos.vlm.words import IMAGE_ID, IMAGE_TOKENS, WORDS, processor, split_words
from vitrim.models.config_limits import check_file_config, check_fits_weights
from vitrim.weights.formats import read_weights_file

if TYPE_CHECKING:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

# (sub-config or "" for the top level, field) -> the value the demo's data, vocabulary and processor need
FIXED: dict[tuple[str, str], object] = {
    ("", "model_type"): "llava",
    ("", "image_token_index"): IMAGE_ID,
    ("", "image_seq_length"): IMAGE_TOKENS,
    ("", "vision_feature_select_strategy"): "default",  # 64 patch tokens, [CLS] dropped: the prompt holds 64 slots
    ("text_config", "model_type"): "llama",
    ("text_config", "vocab_size"): len(WORDS),
    ("vision_config", "model_type"): "clip_vision_model",
    ("vision_config", "image_size"): CANVAS,
    ("vision_config", "patch_size"): PATCH,
    ("vision_config", "num_channels"): 3,
}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def load_digits_vlm(folder: str | Path) -> LlavaForConditionalGeneration:
    """The digits VLM saved in ``folder`` (float32 whatever the file stores), in eval mode, checked (module doc)."""
    return load_checked(folder, "digits VLM run (vitrim demo vlm)", read_config, build_model, _build, check_answers)


def load_checked(
    folder: str | Path,
    run: str,
    read: Callable[[Path], Any],
    build: Callable[[Any], torch.nn.Module],
    build_checked: Callable[[Any, Path], torch.nn.Module],
    answers: Callable[[torch.nn.Module, str], None],
) -> Any:
    """Both digits demos' run folder (this one's and :mod:`vitrim.demos.video.run_folder`'s), read as files from
    anyone: both files there (else ``FileNotFoundError`` saying it is not a ``run``), ``read(config.json)`` the checked
    config, the weights read and checked against ``build_checked(config, path)`` on the meta device
    (:func:`check_weights_fit`), then ``build(config)`` loaded in float32, in eval mode, ``answers(model, folder)``."""
    import_transformers()
    folder = Path(folder)
    for name in (MODEL_FILE, CONFIG_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{str(folder)!r} has no {name}: not a {run}")
    config = read(folder / CONFIG_FILE)
    weights = read_weights_file(folder / MODEL_FILE)[0]
    check_weights_fit(lambda: build_checked(config, folder / CONFIG_FILE), weights, repr(str(folder / MODEL_FILE)))
    model = build(config)
    model.load_state_dict({name: tensor.float() for name, tensor in weights.items()}, strict=True)
    answers(model.eval(), str(folder))
    return model


def read_config(path: Path) -> LlavaConfig:
    """``config.json`` of a run folder -> its ``LlavaConfig``, checked as data (module doc)."""
    from transformers import LlavaConfig

    source = repr(str(path))
    parts = read_fixed_parts(path, FIXED, "the digits VLM's; not a digits VLM run")
    fields = parts[""]
    _check_heads(parts["text_config"], f"{source} text_config", key_value=True)
    _check_heads(parts["vision_config"], f"{source} vision_config", key_value=False)
    _check_feature_layer(fields.get("vision_feature_layer"), parts["vision_config"].get("num_hidden_layers"), source)
    _check_rope(parts["text_config"].get("rope_parameters"), f"{source} text_config.rope_parameters")
    try:
        return LlavaConfig.from_dict(fields)
    except Exception as err:  # transformers' own validation raises its own classes; the file is the cause either way
        raise ValueError(f"{source}: not a LLaVA config transformers accepts ({_first_line(err)})") from None


def read_fixed_parts(path: Path, fixed: dict[tuple[str, str], object], owner: str) -> dict[str, dict[str, Any]]:
    """A run folder's ``config.json`` read as data (:mod:`vitrim.untrusted`): ``{"": the whole object,
    "text_config": …, "vision_config": …}``, each sub-config's sizes checked
    (:func:`~vitrim.models.config_limits.check_file_config`) and every field of ``fixed`` ((sub-config or "", field)
    -> value) equal to its value and type; a problem is one ``ValueError`` naming the file, the field, its value and
    ``owner`` (whose the expected value is)."""
    source = repr(str(path))
    fields = untrusted.expect_object(untrusted.read_json(path), source)
    parts = {"": fields}
    for part in ("text_config", "vision_config"):
        parts[part] = untrusted.expect_object(fields.get(part), f"{source} {part}")
        check_file_config(parts[part], f"{source} {part}")
    for (part, name), expected in fixed.items():
        value = parts[part].get(name)
        if value != expected or type(value) is not type(expected):
            where = f"{part}.{name}" if part else name
            raise ValueError(f"{source}: {where} is {value!r:.80}, expected {expected!r} ({owner})")
    return parts


def _build(config: LlavaConfig, source: Path) -> torch.nn.Module:
    """The model of ``config`` (on the current device: ``meta`` for the checks), or one line naming the file."""
    try:
        return build_model(config)
    except Exception as err:  # e.g. an activation name transformers does not know: KeyError deep in its modules
        raise ValueError(f"{str(source)!r}: its config does not build a LLaVA model ({_first_line(err)})") from None


def _check_heads(fields: dict[str, Any], source: str, *, key_value: bool) -> None:
    """Attention heads that split the width (and, in the decoder, key/value heads that share the query heads)."""
    width, heads = fields.get("hidden_size"), fields.get("num_attention_heads")
    if not isinstance(width, int) or not isinstance(heads, int):
        raise ValueError(
            f"{source}: hidden_size and num_attention_heads must be ints, got {width!r:.40} and {heads!r:.40}"
        )
    if (not key_value or fields.get("head_dim") is None) and width % heads:  # head_dim: sizes checked with the rest
        raise ValueError(f"{source}: hidden_size {width} is not divisible by num_attention_heads {heads}")
    kv_heads = fields.get("num_key_value_heads", heads) if key_value else heads
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}")


def _check_feature_layer(layer: object, depth: object, source: str) -> None:
    if not isinstance(depth, int):
        raise ValueError(f"{source}: vision_config.num_hidden_layers must be an int, got {depth!r:.80}")
    if not isinstance(layer, int) or isinstance(layer, bool) or not -depth <= layer < depth:
        raise ValueError(
            f"{source}: vision_feature_layer is {layer!r:.80}, expected a layer of the {depth}-layer tower "
            f"(an int in [{-depth}, {depth - 1}])"
        )


def _check_rope(rope: object, source: str) -> None:
    """RoPE's parameters as the digits VLM's: the default rotation, a positive finite base (absent: transformers')."""
    if rope is None:
        return
    rope = untrusted.expect_object(rope, source)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_type is {rope.get('rope_type')!r:.80}, expected 'default'")
    theta = rope.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta <= 1e12:
        raise ValueError(f"{source}: rope_theta must be a number in (0, 1e12], got {theta!r:.80}")


def check_weights_fit(build: Callable[[], torch.nn.Module], weights: dict[str, Tensor], source: str) -> None:
    """The model ``build()`` makes, on the ``meta`` device, against the file's tensors: no more values than they
    justify, then the same names, shapes, floating dtypes and finite values; one ``ValueError`` naming ``source``."""
    check_fits_weights(build, weights, source)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in build().state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source} does not fit the digits VLM: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in expected.items():
        tensor = weights[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{source}: {name} has shape {list(tensor.shape)}, but its config.json makes it {list(shape)}"
            )
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{source}: {name} is {tensor.dtype}, expected floating-point weights")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{source}: {name} holds non-finite values (NaN or infinity)")


@torch.no_grad()
def check_answers(model: torch.nn.Module, source: str) -> None:
    """One question about a blank canvas must give finite logits: a config that builds but cannot run is refused."""
    inputs = processor(np.zeros((1, CANVAS, CANVAS), np.float32), [split_words("how many digits ?")])
    try:
        logits = model(**inputs).logits
    except Exception as err:  # whatever the file's config made transformers do: the file is the cause
        raise ValueError(f"{source!r}: its config.json builds a model that does not run ({_first_line(err)})") from None
    if not torch.isfinite(logits).all():
        raise ValueError(f"{source!r}: its model answers a blank canvas with non-finite logits (its config.json's "
                         "numbers, e.g. text_config.rms_norm_eps, do not make a working model)")  # fmt: skip


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."
