"""A checkpoint, its prompts and its answers: the transformers processor of a folder, or the digits VLM's words.

:func:`load` returns the model and a :class:`Prompter`, which turns a batch of (question, visuals) into the model's
inputs, left-padded as ``generate()`` wants, and generated ids back into text:

- ``pretrained=digits`` (or a ``vitrim demo vlm`` run folder): the shipped digits LLaVA and its word-level
  processor (:mod:`vitrim.demos.vlm.words`); a picture becomes the 64×64 canvas of ink in [0, 1] the demo feeds (a
  PIL image of mode ``"F"`` holds the ink itself, the digits tasks' ``doc_to_visual`` makes it; any other picture
  goes through :func:`vitrim.demos.vlm.ask.read_canvas`'s rule: grey, 64×64, inverted when mostly light);
- ``pretrained=digits_video`` (or a ``vitrim demo video`` run folder): the shipped digits video model (a Qwen2-VL) and
  its word-level processor (:func:`vitrim.demos.video.words.processor`), one clip of 8 frames of 32×32 ink per
  question; a video given as a list of frames of mode ``"F"`` at 32×32 (the video digits tasks' ``doc_to_video``)
  is read as it is, any other video (a file, other frames) frame by frame by the canvas' rule at 32×32; frames
  sampled as any video's (:mod:`vitrim.eval.video`; the model takes exactly 8);
- any other folder: transformers' ``AutoProcessor`` and ``AutoModelForImageTextToText`` (:func:`vitrim.vlm_user.
  load.load_vlm`: safetensors only, no remote code), a chat turn with one image part per picture and one video
  part per video (a :class:`vitrim.eval.video.Clip`, in the order ``doc_to_visual`` gave them); the pictures go to
  the processor grouped per prompt (Gemma 3's processor counts them per prompt), the videos as their sampled frames
  with their metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vitrim.eval.model_args import ModelArguments
from vitrim.eval.video import Clip, frame_indices, read_clip

DIGITS = "digits"
DIGITS_VIDEO = "digits_video"


@dataclass(frozen=True)
class Settings:
    """What decides the image tokens besides the method, recorded beside every number: the processor's class, the
    picture size it resizes to or its pixel bounds (Qwen's ``min_pixels`` / ``max_pixels``; its video processor's
    under ``video``), the dtype."""

    processor: str
    pixels: dict[str, Any]
    dtype: str


class Prompter:
    """Inputs of a batch and the text of its answers (module doc)."""

    settings: Settings

    def inputs(self, questions: Sequence[str], visuals: Sequence[Sequence[Any]]) -> dict[str, Tensor]:
        """The batch's inputs: per question its pictures and :class:`~vitrim.eval.video.Clip` s, in order."""
        raise NotImplementedError

    def decode(self, ids: Tensor) -> list[str]:
        raise NotImplementedError

    def read_video(self, visual: Any, max_num_frames: int, fps: float | None) -> Clip:
        """One video of ``doc_to_visual``'s list as the clip this model reads (:func:`vitrim.eval.video.read_clip`)."""
        return read_clip(visual, max_num_frames, fps)

    @property
    def pad_id(self) -> int | None:
        return None


class DigitsPrompter(Prompter):
    """The digits VLM's word processor: one canvas per question."""

    def __init__(self) -> None:
        from vitrim.demos.vlm.data import CANVAS

        self.settings = Settings("vitrim.demos.vlm.words.processor", {"canvas": [CANVAS, CANVAS]}, "float32")

    def inputs(self, questions: Sequence[str], visuals: Sequence[Sequence[Any]]) -> dict[str, Tensor]:
        from vitrim.demos.vlm.data import CANVAS
        from vitrim.demos.vlm.words import processor

        pictures = one_each(visuals, video=False, model="the digits VLM")
        return processor(np.stack([digits_ink(picture, CANVAS) for picture in pictures]), list(questions))

    def decode(self, ids: Tensor) -> list[str]:
        from vitrim.demos.vlm.words import decode_ids

        return [decode_ids(row.tolist()) for row in ids]


class DigitsVideoPrompter(Prompter):
    """The digits video model's word processor: one clip per question, its :class:`~vitrim.eval.video.Clip` holding
    the (8, 32, 32) float32 ink itself rather than RGB frames."""

    def __init__(self) -> None:
        from vitrim.demos.video.data import FRAME, FRAMES

        self.settings = Settings(
            "vitrim.demos.video.words.processor", {"video": {"frames": FRAMES, "frame": [FRAME, FRAME]}}, "float32"
        )

    def read_video(self, visual: Any, max_num_frames: int, fps: float | None) -> Clip:
        """The clip's ink: frames of mode ``"F"`` at 32×32 as they are, any other frames by :func:`digits_ink`;
        sampled as :func:`vitrim.eval.video.read_clip` samples frames; ``ValueError`` unless 8 frames are left."""
        from PIL import Image
        from transformers.video_utils import VideoMetadata

        from vitrim.demos.video.data import FRAME, FRAMES

        if isinstance(visual, (list, tuple)) and all(isinstance(f, Image.Image) for f in visual):
            every = np.stack([digits_ink(frame, FRAME) for frame in visual])
            indices = frame_indices(len(every), max_num_frames, None, fps)
            metadata = VideoMetadata(total_num_frames=len(every), fps=None, height=FRAME, width=FRAME,
                                     frames_indices=indices.tolist())  # fmt: skip
            clip = Clip(every[indices], metadata, "frames")
        else:
            read = read_clip(visual, max_num_frames, fps)
            ink = np.stack([digits_ink(Image.fromarray(frame), FRAME) for frame in read.frames])
            clip = Clip(ink, read.metadata, read.source)
        if len(clip.frames) != FRAMES:
            raise ValueError(
                f"the digits video model reads clips of {FRAMES} frames; this video gives {len(clip.frames)} (of "
                f"{clip.metadata.total_num_frames}, model_args max_num_frames={max_num_frames}, fps={fps})"
            )
        return clip

    def inputs(self, questions: Sequence[str], visuals: Sequence[Sequence[Any]]) -> dict[str, Tensor]:
        from vitrim.demos.video.words import processor

        clips = one_each(visuals, video=True, model="the digits video model")
        return processor(np.stack([clip.frames for clip in clips]), list(questions))

    def decode(self, ids: Tensor) -> list[str]:
        from vitrim.demos.video.words import decode_ids

        return [decode_ids(row.tolist()) for row in ids]


def one_each(visuals: Sequence[Sequence[Any]], *, video: bool, model: str) -> list[Any]:
    """The one visual of each question, a :class:`~vitrim.eval.video.Clip` (``video``) or a picture; ``ValueError``
    naming the question that has another kind or count."""
    kind, other = ("video", "picture") if video else ("picture", "video")
    for number, group in enumerate(visuals):
        if any(isinstance(visual, Clip) != video for visual in group):
            raise ValueError(f"{model} reads {kind}s, not {other}s; question {number} has a {other}")
        if len(group) != 1:
            raise ValueError(f"{model} reads one {kind} per question; question {number} has {len(group)}")
    return [group[0] for group in visuals]


def digits_ink(picture: Any, size: int) -> np.ndarray:
    """(size, size) float32 ink: a mode-"F" image at size×size as it is (the digits tasks' exact canvases and
    frames), any other picture by the rule of ``vitrim vlm ask --run`` (grey, resized, inverted when mostly light,
    in [0, 1])."""
    from PIL import Image

    if not isinstance(picture, Image.Image):
        raise ValueError(f"expected a PIL image, got {type(picture).__name__}")
    if picture.mode == "F" and picture.size == (size, size):
        return np.asarray(picture, dtype=np.float32)
    grey = picture.convert("L").resize((size, size), Image.Resampling.BILINEAR)
    ink = np.asarray(grey, dtype=np.float32) / 255.0
    return (1.0 - ink if ink.mean() > 0.5 else ink).astype(np.float32)


class TransformersPrompter(Prompter):
    """A transformers processor: a chat turn (``{"type": "image"}`` per picture, ``{"type": "video"}`` per video,
    then the question) when it has a template, else its image / video token per visual before the question; padded
    on the left."""

    def __init__(self, processor: Any, dtype: str) -> None:
        self.processor = processor
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.padding_side = "left"
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
        self.settings = Settings(type(processor).__name__, pixel_settings(processor), dtype)

    def inputs(self, questions: Sequence[str], visuals: Sequence[Sequence[Any]]) -> dict[str, Tensor]:
        texts = [self.prompt(question, group) for question, group in zip(questions, visuals, strict=True)]
        pictures = [[rgb(v) for v in group if not isinstance(v, Clip)] for group in visuals]
        clips = [v for group in visuals for v in group if isinstance(v, Clip)]
        extra: dict[str, Any] = {}
        if clips:
            if getattr(self.processor, "video_processor", None) is None:
                raise ValueError(f"{type(self.processor).__name__} takes no video (it has no video processor)")
            extra = {
                "videos": [clip.frames for clip in clips],
                "video_metadata": [clip.metadata for clip in clips],
                "do_sample_frames": False,  # sampled by vitrim.eval.video, recorded with each sample
            }
        images = pictures if any(pictures) else None
        try:
            return dict(self.processor(images=images, text=texts, return_tensors="pt", padding=True, **extra))
        except ValueError as error:  # LLaVA-OneVision stacks a batch's videos as (V, F, C, H, W)
            counts = sorted({len(clip.frames) for clip in clips})
            if len(counts) < 2 or "pixel_values_videos" not in str(error):
                raise
            raise ValueError(
                f"{type(self.processor).__name__} stacks a batch's videos frame for frame; this batch's videos have "
                f"{counts} frames: use --batch_size 1, or max_num_frames at most the shortest video's frames"
            ) from None

    def prompt(self, question: str, visuals: Sequence[Any]) -> str:
        """The prompt text of one question with its visuals (pictures, then videos, in order, before the text)."""
        processor = self.processor
        kinds = ["video" if isinstance(v, Clip) else "image" for v in visuals]
        if getattr(processor, "chat_template", None):
            content = [{"type": kind} for kind in kinds] + [{"type": "text", "text": question}]
            messages = [{"role": "user", "content": content}]
            return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        tokens = {kind: getattr(processor, f"{kind}_token", None) for kind in set(kinds) | {"image"}}
        missing = [kind for kind, token in tokens.items() if not token]
        if missing:
            raise ValueError(
                f"{type(processor).__name__} has neither a chat template nor a {missing[0]} token to prompt with"
            )
        return "".join(str(tokens[kind]) for kind in kinds) + "\n" + question

    def decode(self, ids: Tensor) -> list[str]:
        return [text.strip() for text in self.processor.batch_decode(ids, skip_special_tokens=True)]

    @property
    def pad_id(self) -> int | None:
        tokenizer = getattr(self.processor, "tokenizer", None)
        return None if tokenizer is None else tokenizer.pad_token_id


PIXEL_SETTINGS = ("size", "crop_size", "min_pixels", "max_pixels", "patch_size", "merge_size", "do_resize", "do_pad")
VIDEO_SETTINGS = ("temporal_patch_size", "fps", "num_frames", "min_frames", "max_frames", "cap_pixels_per_frame")


def pixel_settings(processor: Any) -> dict[str, Any]:
    """The image processor's settings that decide how many image tokens a picture makes (and, under ``video``, the
    video processor's: pixel bounds, temporal patch, its own frame sampling, which vitrim's sampling replaces)."""
    found = _settings(getattr(processor, "image_processor", None), PIXEL_SETTINGS)
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is not None:
        found["video"] = _settings(video_processor, PIXEL_SETTINGS + VIDEO_SETTINGS)
    return found


def _settings(processor: Any, names: tuple[str, ...]) -> dict[str, Any]:
    found = {name: getattr(processor, name, None) for name in names}
    return {name: _plain(value) for name, value in found.items() if value is not None}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # transformers 5's SizeDict
        value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (int, float, str, bool)) else repr(value)


def rgb(picture: Any) -> Any:
    """A picture as RGB (a mode-"F" canvas of ink in [0, 1] scaled to 8 bits first)."""
    from PIL import Image

    if isinstance(picture, Image.Image) and picture.mode == "F":
        ink = np.clip(np.asarray(picture, dtype=np.float32), 0.0, 1.0)
        picture = Image.fromarray(np.round(ink * 255).astype(np.uint8))
    return picture.convert("RGB") if isinstance(picture, Image.Image) else picture


def load(arguments: ModelArguments) -> tuple[nn.Module, Prompter]:
    """The model (eval mode, on ``arguments.device``, in ``arguments.dtype``) and its :class:`Prompter`."""
    dtype = getattr(torch, arguments.dtype)
    if arguments.pretrained == DIGITS or _is_digits_run(arguments.pretrained, "llava", "vlm"):
        from vitrim.demos.vlm.ask import load_demo_model

        model = load_demo_model(None if arguments.pretrained == DIGITS else arguments.pretrained)
        return model.to(device=arguments.device, dtype=dtype).eval(), DigitsPrompter()
    if arguments.pretrained == DIGITS_VIDEO or _is_digits_run(arguments.pretrained, "qwen2_vl", "video"):
        from vitrim.demos.video.run_folder import load_video_model
        from vitrim.shipped import shipped_run

        folder = shipped_run("video") if arguments.pretrained == DIGITS_VIDEO else arguments.pretrained
        video_model: nn.Module = load_video_model(folder)  # typed as a Module: transformers types its `to` oddly
        return video_model.to(device=arguments.device, dtype=dtype).eval(), DigitsVideoPrompter()
    from vitrim.vlm_user.load import load_vlm

    model, processor = load_vlm(arguments.pretrained, arguments.device)
    for argument, part in PIXEL_BOUNDS.items():
        value = getattr(arguments, argument)
        if value is not None:
            _set_pixel_bound(processor, part, argument.removeprefix("video_"), value, argument)
    return model.to(dtype=dtype).eval(), TransformersPrompter(processor, arguments.dtype)


# model_args -> the processor part whose bound it sets
PIXEL_BOUNDS = {
    "min_pixels": "image_processor",
    "max_pixels": "image_processor",
    "video_min_pixels": "video_processor",
    "video_max_pixels": "video_processor",
}


def _set_pixel_bound(processor: Any, part: str, name: str, value: int, argument: str) -> None:
    """Qwen's ``min_pixels`` / ``max_pixels`` (``name``) of the processor's ``part``, wherever that version keeps
    them (the ``size`` dict's shortest/longest edge, a SizeDict's, or an attribute)."""
    target = getattr(processor, part, None)
    size = getattr(target, "size", None)
    key = "shortest_edge" if name == "min_pixels" else "longest_edge"
    if isinstance(size, dict) and key in size:
        size[key] = value
    elif getattr(size, key, None) is not None:  # transformers 5's Qwen processors: pixel bounds in a SizeDict
        setattr(size, key, value)
    elif target is not None and hasattr(target, name):
        setattr(target, name, value)
    else:
        raise ValueError(f"model_args {argument}={value}: {type(processor).__name__} has no {part} {name} setting")


def _is_digits_run(pretrained: str, model_type: str, demo: str) -> bool:
    """A ``vitrim demo vlm`` (``demo`` "vlm": a LLaVA) or ``vitrim demo video`` ("video": a Qwen2-VL) run folder: its
    config.json is a ``model_type`` model over that demo's words."""
    from importlib import import_module

    from vitrim import untrusted

    config = Path(pretrained) / "config.json"
    if not config.is_file():
        return False
    words = import_module(f"vitrim.demos.{demo}.words").WORDS
    read = untrusted.read_json(config)
    text = read.get("text_config", {}) if isinstance(read, dict) else {}
    return isinstance(text, dict) and text.get("vocab_size") == len(words) and read.get("model_type") == model_type
