"""A digits video model run folder read as files from someone else (``vitrim demo video`` installs the shipped one
this way too): the same checks as the digits LLaVA's (:mod:`vitrim.demos.vlm.run_folder`), each problem one
``ValueError`` naming the file, the field and its value.

* ``config.json`` through :mod:`vitrim.untrusted`, both sub-configs' sizes through
  :func:`vitrim.models.config_limits.check_file_config`;
* the fields the demo's clips, vocabulary and processor fix (:data:`FIXED`: a Qwen2-VL, its special tokens, 4-pixel
  patches merged 2×2, two frames per temporal patch, 3 channels, the vocabulary's size) must say so; M-RoPE's three
  sections must be ints summing to half a head;
* the weights through vitrim's checkpoint reader, the model the config describes built on the ``meta`` device and
  compared tensor by tensor (:func:`vitrim.demos.vlm.run_folder.check_weights_fit`) before a real tensor is made;
* last, the model answers one blank clip with finite logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vitrim import untrusted
from vitrim.demos.video.data import FRAME, FRAMES, MERGE, PATCH, TEMPORAL_PATCH
from vitrim.demos.video.model import build_model
from vitrim.demos.video.words import (
    IMAGE_ID,
    VIDEO_ID,
    VISION_END_ID,
    VISION_START_ID,
    WORDS,
    processor,
)
from vitrim.demos.vlm.run_folder import _check_heads, _first_line, load_checked, read_fixed_parts
from vitrim.demos.vlm.words import split_words

if TYPE_CHECKING:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

FIXED: dict[tuple[str, str], object] = {
    ("", "model_type"): "qwen2_vl",
    ("", "image_token_id"): IMAGE_ID,
    ("", "video_token_id"): VIDEO_ID,
    ("", "vision_start_token_id"): VISION_START_ID,
    ("", "vision_end_token_id"): VISION_END_ID,
    ("text_config", "model_type"): "qwen2_vl_text",
    ("text_config", "vocab_size"): len(WORDS),
    ("vision_config", "model_type"): "qwen2_vl_vision",
    ("vision_config", "patch_size"): PATCH,
    ("vision_config", "spatial_merge_size"): MERGE,
    ("vision_config", "temporal_patch_size"): TEMPORAL_PATCH,
    ("vision_config", "in_channels"): 3,
}


def load_video_model(folder: str | Path) -> Qwen2VLForConditionalGeneration:
    """The digits video model saved in ``folder`` (float32 whatever the file stores), in eval mode, checked."""
    run = "digits video model run (vitrim demo video)"
    return load_checked(folder, run, read_config, build_model, _build, check_answers)


def read_config(path: Path) -> Qwen2VLConfig:
    """``config.json`` of a run folder -> its ``Qwen2VLConfig``, checked as data (module doc)."""
    from transformers import Qwen2VLConfig

    source = repr(str(path))
    parts = read_fixed_parts(path, FIXED, "the digits video model's")
    _check_heads(parts["text_config"], f"{source} text_config", key_value=True)
    vision = parts["vision_config"]
    _check_heads({"hidden_size": vision.get("embed_dim"), "num_attention_heads": vision.get("num_heads")},
                 f"{source} vision_config (embed_dim, num_heads)", key_value=False)  # fmt: skip
    _check_mrope(parts["text_config"], f"{source} text_config.rope_parameters")
    try:
        return Qwen2VLConfig.from_dict(parts[""])
    except Exception as err:  # transformers' own validation raises its own classes; the file is the cause either way
        raise ValueError(f"{source}: not a Qwen2-VL config transformers accepts ({_first_line(err)})") from None


def _check_mrope(text: dict[str, Any], source: str) -> None:
    """M-RoPE's default rotation, a positive finite base, and three sections that split half a head's dimensions."""
    rope = untrusted.expect_object(text.get("rope_parameters"), source)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_type is {rope.get('rope_type')!r:.80}, expected 'default'")
    theta = rope.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta <= 1e12:
        raise ValueError(f"{source}: rope_theta must be a number in (0, 1e12], got {theta!r:.80}")
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    section = rope.get("mrope_section")
    if (
        not isinstance(section, list)
        or len(section) != 3
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
        or sum(section) != head // 2
    ):
        raise ValueError(f"{source}: mrope_section is {section!r:.80}, expected 3 ints >= 0 summing to {head // 2}")


def _build(config: Qwen2VLConfig, source: Path) -> torch.nn.Module:
    try:
        return build_model(config)
    except Exception as err:  # e.g. an activation name transformers does not know: KeyError deep in its modules
        raise ValueError(f"{str(source)!r}: its config does not build a Qwen2-VL model ({_first_line(err)})") from None


@torch.no_grad()
def check_answers(model: torch.nn.Module, source: str) -> None:
    """One question about a blank clip must give finite logits: a config that builds but cannot run is refused."""
    inputs = processor(np.zeros((1, FRAMES, FRAME, FRAME), np.float32), [split_words("which digit appears ?")])
    try:
        logits = model(**inputs).logits
    except Exception as err:  # whatever the file's config made transformers do: the file is the cause
        raise ValueError(f"{source!r}: its config.json builds a model that does not run ({_first_line(err)})") from None
    if not torch.isfinite(logits).all():
        raise ValueError(f"{source!r}: its model answers a blank clip with non-finite logits (its config.json's "
                         "numbers do not make a working model)")  # fmt: skip


__all__ = ["FIXED", "load_video_model", "read_config"]
