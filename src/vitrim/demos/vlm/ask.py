"""Questions to the digits VLM about any picture: ``vitrim vlm ask`` and ``vitrim viz vlm`` call these.

A picture is read as grey, resized to the 64×64 canvas and scaled to [0, 1]; the model was trained on light ink on
black, so a picture that is mostly light (mean above one half: dark ink on paper) is inverted first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from vitrim.data.images import read_image
from vitrim.demos.vlm.data import CANVAS
from vitrim.demos.vlm.evaluate import MAX_ANSWER_TOKENS
from vitrim.demos.vlm.run_folder import load_digits_vlm
from vitrim.demos.vlm.words import IMAGE_TOKENS, decode_ids, processor, split_words
from vitrim.shipped import shipped_run


def load_demo_model(run: str | Path | None = None) -> nn.Module:
    """The model of a ``vitrim demo vlm`` run folder, or the shipped one (``run`` None)."""
    return load_digits_vlm(shipped_run("vlm") if run is None else Path(run))


def read_canvas(path: str | Path, name: str = "--image") -> np.ndarray:
    """(64, 64) float32 ink in [0, 1] from a PNG/JPEG file (module doc: resized, inverted when mostly light)."""
    grey = read_image(path, (CANVAS, CANVAS), 1, mean=0.0, std=1.0, name=name)[0].numpy()  # (64, 64) in [0, 1]
    return (1.0 - grey if grey.mean() > 0.5 else grey).astype(np.float32)


def save_canvas(canvas: np.ndarray, path: Path) -> None:
    """Write a (64, 64) canvas of ink in [0, 1] as an 8-bit grey PNG (light ink on black, as the model saw it), which
    :func:`read_canvas` reads back to within 1/255."""
    from PIL import Image

    Image.fromarray(np.round(np.clip(canvas, 0.0, 1.0) * 255).astype(np.uint8)).save(path)  # 2-D uint8: mode L


STAGE_WORDS = {"pre_llm": "before the LLM", "in_llm": "inside the LLM", "tower": "inside the vision tower"}


@dataclass(frozen=True)
class Answer:
    """The answer text and, with a method: the raster indices of the image tokens the LLM's last layer saw (``kept``,
    sorted), per kept token the indices it stands for (``groups``: its own, or a merged token's members) and the
    method's stage."""

    text: str
    groups: list[Tensor] | None
    stage: str | None = None
    kept: list[int] | None = None

    def describe_tokens(self, method: str) -> str:
        """One line: which of the 64 image tokens ``method`` kept, where, and what the merged ones stand for."""
        if self.groups is None or self.stage is None or self.kept is None:
            return f"{method}: nothing was trimmed"
        merged = [g for g in self.groups if g.numel() > 1]
        reached = "reached the LLM's last layer" if self.stage == "in_llm" else "entered the LLM"
        line = f"{method} ({STAGE_WORDS[self.stage]}): {len(self.groups)} of {IMAGE_TOKENS} image tokens {reached}"
        line += f", patches {self.kept}"
        if merged:
            line += f"; {len(merged)} of them merged, standing for {sum(g.numel() for g in merged)} patches"
        return line


@torch.no_grad()
def ask(model: nn.Module, canvas: np.ndarray, question: str, *, method: str | None = None, keep: float = 1.0) -> Answer:
    """Greedy answer of ``model`` (trimmed by ``method`` at ``keep`` when given, with the options the demo gives that
    method: ``vitrim.demos.vlm.sweep.demo_options``; the model itself is not changed)."""
    import copy

    words = split_words(question)
    inputs = processor(canvas[None], [words])  # checks every word before the model runs
    if method is None:
        generated = model.generate(**inputs, max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False)  # type: ignore[operator]
        return Answer(decode_ids(generated[0, inputs["input_ids"].shape[1] :].tolist()), None)
    from vitrim import vlm
    from vitrim.demos.vlm.sweep import demo_options

    trimmed = vlm.apply(copy.deepcopy(model), method, **demo_options(method, keep))
    generated = trimmed.generate(**inputs, max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False)  # type: ignore[operator]
    groups = list(vlm.last_selection(trimmed, groups=True)[0])
    kept = [int(i) for i in torch.as_tensor(vlm.last_selection(trimmed)[0]).tolist()]
    text = decode_ids(generated[0, inputs["input_ids"].shape[1] :].tolist())
    return Answer(text, groups, vlm.method_info(method).stage, kept)
