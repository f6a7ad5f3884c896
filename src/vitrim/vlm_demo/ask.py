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
from vitrim.shipped import shipped_run
from vitrim.vlm_demo.data import CANVAS
from vitrim.vlm_demo.evaluate import MAX_ANSWER_TOKENS
from vitrim.vlm_demo.run_folder import load_digits_vlm
from vitrim.vlm_demo.words import decode_ids, processor, split_words


def load_demo_model(run: str | Path | None = None) -> nn.Module:
    """The model of a ``vitrim demo vlm`` run folder, or the shipped one (``run`` None)."""
    return load_digits_vlm(shipped_run("vlm") if run is None else Path(run))


def read_canvas(path: str | Path, name: str = "--image") -> np.ndarray:
    """(64, 64) float32 ink in [0, 1] from a PNG/JPEG file (module doc: resized, inverted when mostly light)."""
    grey = read_image(path, (CANVAS, CANVAS), 1, mean=0.0, std=1.0, name=name)[0].numpy()  # (64, 64) in [0, 1]
    return (1.0 - grey if grey.mean() > 0.5 else grey).astype(np.float32)


def parse_keep(text: str) -> int | float:
    """``--keep``: ``"16"`` -> 16 image tokens, ``"0.25"`` -> a quarter of them."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--keep must be a token count (e.g. 16) or a fraction (e.g. 0.25), got {text!r}") from None


@dataclass(frozen=True)
class Answer:
    """The answer text and, with a method, the groups of image-token indices that entered the LLM."""

    text: str
    groups: list[Tensor] | None


@torch.no_grad()
def ask(model: nn.Module, canvas: np.ndarray, question: str, *, method: str | None = None, keep: float = 1.0) -> Answer:
    """Greedy answer of ``model`` (trimmed by ``method`` at ``keep`` when given; the model itself is not changed)."""
    import copy

    words = split_words(question)
    inputs = processor(canvas[None], [words])  # checks every word before the model runs
    groups = None
    if method is not None:
        from vitrim import vlm

        model = vlm.apply(copy.deepcopy(model), method, keep=keep)
    generated = model.generate(**inputs, max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False)  # type: ignore[operator]
    if method is not None:
        from vitrim import vlm

        groups = list(vlm.last_selection(model, groups=True)[0])
    return Answer(decode_ids(generated[0, inputs["input_ids"].shape[1] :].tolist()), groups)
