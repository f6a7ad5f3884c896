"""Ask a user's VLM one question about one picture, with a method of :mod:`vitrim.vlm` applied, and keep the record.

The prompt is the processor's chat template (a user turn: the image, then the question) when it has one, else the
processor's image token and the question. The method is applied for the one ``generate()`` (greedy) and removed
after, so the model is returned as it was; what it selected is read with :func:`vitrim.vlm.last_selection` before.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import vitrim.vlm
from vitrim.viz.vlm_boxes import TokenBoxes, vlm_token_boxes
from vitrim.vlm.stacking import STAGE_ORDER


@dataclass
class Answer:
    """One question answered.

    text: the reply; method / stage / options: what was applied (None: the unmodified model);
    total: per image, its image tokens in the unmodified LLM input; entered: per image, the image tokens that entered
    the LLM (merged ones count once; an in-LLM method lets all in); selected: per image, the tokens the method kept
    (the LLM tokens standing for the image; in-LLM: from its layer on); groups: per image, one LongTensor per such
    token (``last_selection(model, groups=True)``; an empty one, first, is the tower's [CLS]), None without a method;
    kept: per image, the kept indices
    (``last_selection(model)``); boxes: per image, where each token is in the picture; inputs: what the processor
    made (input_ids, pixel_values, …); stack: per method applied (stage order), its name, stage and options.
    """

    text: str
    method: str | None
    stage: str | None
    options: dict[str, Any]
    total: list[int]
    entered: list[int]
    selected: list[int]
    groups: list[list[Tensor]] | None
    kept: list[list[int]] | None
    boxes: list[TokenBoxes]
    inputs: dict[str, Any] = field(repr=False)
    family: str = ""
    stack: list[dict[str, Any]] = field(default_factory=list)

    def records(self) -> dict[str, Any]:
        """The selection as JSON-ready data: per image its kept indices, groups, token grid and boxes."""
        images = []
        for number, boxes in enumerate(self.boxes):
            groups = None if self.groups is None else self.groups[number]
            images.append(
                {
                    "size": {"height": boxes.size[0], "width": boxes.size[1]},
                    "tokens": self.total[number],
                    "entered": self.entered[number],
                    "selected": self.selected[number],
                    "kept": None if self.kept is None else self.kept[number],
                    "groups": None if groups is None else [g.reshape(-1).tolist() for g in groups],
                    # an empty group (always first) is the tower's [CLS], which stands for no patch
                    "cls": None if groups is None else bool(groups and groups[0].numel() == 0),
                    "views": [
                        {"name": name, "grid": list(grid)} for name, grid in zip(boxes.views, boxes.grids, strict=True)
                    ],
                    "token_view": boxes.view.tolist(),
                    "boxes": [
                        None if math.isnan(row[0]) else [round(v, 4) for v in row] for row in boxes.boxes.tolist()
                    ],
                }
            )
        return {
            "family": self.family,
            "method": self.method,
            "stage": self.stage,
            "options": _jsonable(self.options),
            "stack": self.stack,
            "answer": self.text,
            "images": images,
        }


def _jsonable(options: dict[str, Any]) -> dict[str, Any]:
    """Options as JSON holds them: tuples as lists, anything else not JSON as its repr."""
    options = {name: list(value) if isinstance(value, tuple) else value for name, value in options.items()}
    return {
        name: value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
        for name, value in options.items()
    }


def build_inputs(processor: Any, image: Any, question: str) -> dict[str, Any]:
    """The processor's tensors for one picture and one question (a chat turn when the processor has a template)."""
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        image_token = getattr(processor, "image_token", None)
        if not image_token:
            raise ValueError(
                f"{type(processor).__name__} has neither a chat template nor an image token to prompt with"
            )
        text = f"{image_token}\n{question}"
    return dict(processor(images=[image], text=[text], return_tensors="pt"))


def ask(
    model: nn.Module,
    processor: Any,
    image: Any,
    question: str,
    method: str | list[tuple[str, dict[str, Any]]] | None = None,
    max_new_tokens: int = 32,
    **options: Any,
) -> Answer:
    """Answer ``question`` about ``image`` (a PIL image) greedily, with ``method`` applied (``options``: ``keep=``
    and the method's own, as :func:`vitrim.vlm.apply` takes them); the model is left as it was.

    ``method`` may be a stack: a list of ``(name, options)``, one method per stage (``vitrim.vlm.stacking``), e.g.
    ``[("visionzip", {"keep": 8}), ("fastv", {"keep": 0.5, "layer": 1})]``; ``options`` must then be empty. The
    answer's ``method`` names them joined by "+", its ``stage`` and ``options`` are the last stage's, and what it
    selected is what goes furthest (``last_selection``'s default)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    from vitrim.vlm.api import STATE_ATTRIBUTE
    from vitrim.vlm.families import find_family

    stack = _as_stack(method, options)
    family = find_family(model)
    device = next(model.parameters()).device
    inputs = {
        k: v.to(device) if isinstance(v, Tensor) else v for k, v in build_inputs(processor, image, question).items()
    }
    image_token = family.image_token_id()
    total = [int((inputs["input_ids"] == image_token).sum())]
    for number, (name, named) in enumerate(stack):
        try:
            vitrim.vlm.apply(model, name, **named)
        except BaseException:
            if number:
                vitrim.vlm.remove(model)
            raise
    try:
        with torch.inference_mode():
            generate: Any = model.generate
            out = generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        groups, kept, entered = None, None, total
        if stack:
            selection = vitrim.vlm.last_selection(model, groups=True)
            groups = [list(image_groups) for image_groups in selection]
            kept = [k.tolist() for k in vitrim.vlm.last_selection(model)]
            handoff = getattr(model, STATE_ATTRIBUTE).stack.handoff  # the pre-LLM stage shortening the LLM input
            # a [CLS] the method hands the LLM (VisionZip) enters beside the kept image tokens
            entered = total if handoff is None else [len(image.kept) + image.cls for image in handoff.selection()]
    finally:
        if stack:
            vitrim.vlm.remove(model)
    text = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0].strip()
    size = (image.height, image.width)
    stages = [vitrim.vlm.method_info(name).stage for name, _ in stack]
    boxes = vlm_token_boxes(model, processor, inputs, [size], stage=stages[-1] if stages else None)
    return Answer(
        text=text,
        method="+".join(name for name, _ in stack) or None,
        stage=stages[-1] if stages else None,
        options=dict(stack[-1][1]) if stack else {},
        total=total,
        entered=entered,
        selected=total if groups is None else [len(g) for g in groups],
        groups=groups,
        kept=kept,
        boxes=boxes,
        inputs=inputs,
        family=family.traits.title,
        stack=[
            {"method": name, "stage": stage, "options": _jsonable(named)}
            for (name, named), stage in zip(stack, stages, strict=True)
        ],
    )


def _as_stack(
    method: str | list[tuple[str, dict[str, Any]]] | None, options: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """``method`` (a name, a list of (name, options), or None) as a list of (name, options)."""
    if method is None:
        if options:
            raise ValueError(f"options {sorted(options)} need a method")
        return []
    if isinstance(method, str):
        return [(method, dict(options))]
    if options:
        raise ValueError("with a stack of methods, give each its options in the list: [(name, {options}), ...]")
    stack = [(name, dict(named)) for name, named in method]
    if not stack:
        raise ValueError("method=[] names no method; give None for the unmodified model")
    # the model runs a stack in stage order whatever the order given (vitrim.vlm.stacking): so does the answer, whose
    # method, stage and options are the last stage's (the in-LLM one of "fastv, then visionzip")
    stage_of = {name: vitrim.vlm.method_info(name).stage for name, _ in stack}
    return sorted(stack, key=lambda entry: STAGE_ORDER.index(stage_of[entry[0]]))


def save_answer(answer: Answer, image: Any, folder: Path, title: str = "") -> list[Path]:
    """Write ``selection.json`` and (with a method) ``kept_tokens.png`` into ``folder``; returns the paths."""
    from vitrim.viz.maps import save_figure
    from vitrim.viz.vlm_kept import plot_vlm_kept

    folder.mkdir(parents=True, exist_ok=True)
    record = answer.records()
    written = [folder / "selection.json"]
    written[0].write_text(json.dumps(record, indent=1) + "\n")
    if answer.groups is not None:
        path = folder / "kept_tokens.png"
        save_figure(plot_vlm_kept(image, answer.boxes[0], answer.groups[0], title=title), path)
        written.append(path)
    return written
