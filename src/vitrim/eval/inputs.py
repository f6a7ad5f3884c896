"""A checkpoint, its prompts and its answers: the transformers processor of a folder, or the digits VLM's words.

:func:`load` returns the model and a :class:`Prompter`, which turns a batch of (question, images) into the model's
inputs, left-padded as ``generate()`` wants, and generated ids back into text:

- ``pretrained=digits`` (or a ``vitrim demo vlm`` run folder): the shipped digits LLaVA and its word-level
  processor (:mod:`vitrim.demos.vlm.words`); a picture becomes the 64×64 canvas of ink in [0, 1] the demo feeds (a
  PIL image of mode ``"F"`` holds the ink itself, the digits tasks' ``doc_to_visual`` makes it; any other picture
  goes through :func:`vitrim.demos.vlm.ask.read_canvas`'s rule: grey, 64×64, inverted when mostly light);
- any other folder: transformers' ``AutoProcessor`` and ``AutoModelForImageTextToText`` (:func:`vitrim.vlm_user.
  load.load_vlm`: safetensors only, no remote code), a chat turn with one image part per picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vitrim.eval.model_args import ModelArguments

DIGITS = "digits"


@dataclass(frozen=True)
class Settings:
    """What decides the image tokens besides the method, recorded beside every number: the processor's class, the
    picture size it resizes to or its pixel bounds (Qwen's ``min_pixels`` / ``max_pixels``), the dtype."""

    processor: str
    pixels: dict[str, Any]
    dtype: str


class Prompter:
    """Inputs of a batch and the text of its answers (module doc)."""

    settings: Settings

    def inputs(self, questions: Sequence[str], images: Sequence[Sequence[Any]]) -> dict[str, Tensor]:
        raise NotImplementedError

    def decode(self, ids: Tensor) -> list[str]:
        raise NotImplementedError

    @property
    def pad_id(self) -> int | None:
        return None


class DigitsPrompter(Prompter):
    """The digits VLM's word processor: one canvas per question."""

    def __init__(self) -> None:
        from vitrim.demos.vlm.data import CANVAS

        self.settings = Settings("vitrim.demos.vlm.words.processor", {"canvas": [CANVAS, CANVAS]}, "float32")

    def inputs(self, questions: Sequence[str], images: Sequence[Sequence[Any]]) -> dict[str, Tensor]:
        from vitrim.demos.vlm.words import processor

        for number, pictures in enumerate(images):
            if len(pictures) != 1:
                raise ValueError(
                    f"the digits VLM reads one picture per question; question {number} has {len(pictures)}"
                )
        canvases = np.stack([digits_canvas(pictures[0]) for pictures in images])
        return processor(canvases, list(questions))

    def decode(self, ids: Tensor) -> list[str]:
        from vitrim.demos.vlm.words import decode_ids

        return [decode_ids(row.tolist()) for row in ids]


def digits_canvas(picture: Any) -> np.ndarray:
    """(64, 64) float32 ink: a mode-"F" image at 64×64 as it is (the digits tasks' exact canvases), any other picture
    by the rule of ``vitrim vlm ask --run`` (grey, resized, inverted when mostly light, in [0, 1])."""
    from PIL import Image

    from vitrim.demos.vlm.data import CANVAS

    if not isinstance(picture, Image.Image):
        raise ValueError(f"expected a PIL image, got {type(picture).__name__}")
    if picture.mode == "F" and picture.size == (CANVAS, CANVAS):
        return np.asarray(picture, dtype=np.float32)
    grey = picture.convert("L").resize((CANVAS, CANVAS), Image.Resampling.BILINEAR)
    ink = np.asarray(grey, dtype=np.float32) / 255.0
    return (1.0 - ink if ink.mean() > 0.5 else ink).astype(np.float32)


class TransformersPrompter(Prompter):
    """A transformers processor: a chat turn (``{"type": "image"}`` per picture, then the question) when it has a
    template, else its image token per picture before the question; padded on the left."""

    def __init__(self, processor: Any, dtype: str) -> None:
        self.processor = processor
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.padding_side = "left"
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
        self.settings = Settings(type(processor).__name__, pixel_settings(processor), dtype)

    def inputs(self, questions: Sequence[str], images: Sequence[Sequence[Any]]) -> dict[str, Tensor]:
        texts = [self._prompt(question, len(pictures)) for question, pictures in zip(questions, images, strict=True)]
        pictures = [_rgb(picture) for group in images for picture in group]
        return dict(self.processor(images=pictures or None, text=texts, return_tensors="pt", padding=True))

    def _prompt(self, question: str, pictures: int) -> str:
        processor = self.processor
        if getattr(processor, "chat_template", None):
            content = [{"type": "image"}] * pictures + [{"type": "text", "text": question}]
            messages = [{"role": "user", "content": content}]
            return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        image_token = getattr(processor, "image_token", None)
        if not image_token:
            raise ValueError(
                f"{type(processor).__name__} has neither a chat template nor an image token to prompt with"
            )
        return image_token * pictures + "\n" + question

    def decode(self, ids: Tensor) -> list[str]:
        return [text.strip() for text in self.processor.batch_decode(ids, skip_special_tokens=True)]

    @property
    def pad_id(self) -> int | None:
        tokenizer = getattr(self.processor, "tokenizer", None)
        return None if tokenizer is None else tokenizer.pad_token_id


def pixel_settings(processor: Any) -> dict[str, Any]:
    """The image processor's settings that decide how many image tokens a picture makes."""
    image_processor = getattr(processor, "image_processor", None)
    names = ("size", "crop_size", "min_pixels", "max_pixels", "patch_size", "merge_size", "do_resize", "do_pad")
    found = {name: getattr(image_processor, name, None) for name in names}
    return {name: _plain(value) for name, value in found.items() if value is not None}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (int, float, str, bool)) else repr(value)


def _rgb(picture: Any) -> Any:
    """A picture as RGB (a mode-"F" canvas of ink in [0, 1] scaled to 8 bits first)."""
    from PIL import Image

    if isinstance(picture, Image.Image) and picture.mode == "F":
        ink = np.clip(np.asarray(picture, dtype=np.float32), 0.0, 1.0)
        picture = Image.fromarray(np.round(ink * 255).astype(np.uint8))
    return picture.convert("RGB") if isinstance(picture, Image.Image) else picture


def load(arguments: ModelArguments) -> tuple[nn.Module, Prompter]:
    """The model (eval mode, on ``arguments.device``, in ``arguments.dtype``) and its :class:`Prompter`."""
    dtype = getattr(torch, arguments.dtype)
    if arguments.pretrained == DIGITS or _is_digits_run(arguments.pretrained):
        from vitrim.demos.vlm.ask import load_demo_model

        model = load_demo_model(None if arguments.pretrained == DIGITS else arguments.pretrained)
        return model.to(device=arguments.device, dtype=dtype).eval(), DigitsPrompter()
    from vitrim.vlm_user.load import load_vlm

    model, processor = load_vlm(arguments.pretrained, arguments.device)
    image_processor = getattr(processor, "image_processor", None)
    for name in ("min_pixels", "max_pixels"):
        value = getattr(arguments, name)
        if value is None:
            continue
        size = getattr(image_processor, "size", None)
        key = "shortest_edge" if name == "min_pixels" else "longest_edge"
        if isinstance(size, dict) and key in size:
            size[key] = value
        elif getattr(size, key, None) is not None:  # transformers 5's Qwen processors: pixel bounds in a SizeDict
            setattr(size, key, value)
        elif image_processor is not None and hasattr(image_processor, name):
            setattr(image_processor, name, value)
        else:
            raise ValueError(f"model_args {name}={value}: {type(processor).__name__} has no {name} setting")
    return model.to(dtype=dtype).eval(), TransformersPrompter(processor, arguments.dtype)


def _is_digits_run(pretrained: str) -> bool:
    """A ``vitrim demo vlm`` run folder: its config.json is a LLaVA over the digits' 28 words."""
    from vitrim import untrusted
    from vitrim.demos.vlm.words import WORDS

    config = Path(pretrained) / "config.json"
    if not config.is_file():
        return False
    read = untrusted.read_json(config)
    text = read.get("text_config", {}) if isinstance(read, dict) else {}
    return isinstance(text, dict) and text.get("vocab_size") == len(WORDS) and read.get("model_type") == "llava"
