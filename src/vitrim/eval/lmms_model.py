"""``lmms-eval --model vitrim``: a transformers VLM with vitrim.vlm's methods, as an lmms-eval model.

Registered through lmms-eval's entry-point group ``lmms_eval.models`` (pyproject.toml, :func:`vitrim.eval.manifests`);
``--model_args`` as :mod:`vitrim.eval.model_args` reads them. Requests are batched as lmms-eval's own transformers
models batch them (``lmms_eval.utils.Collator``: grouped by generation settings, ``batch_size`` at a time), padded on
the left, answered greedily by ``model.generate``; the answers go back in the requests' order.

Beside every answer the model reports, in lmms-eval's own places:

- per sample, in the samples log (``--log_samples``), its ``token_counts``: ``input_tokens`` / ``output_tokens``
  (the prompt's tokens, the answer's) and under ``vitrim`` the sample's image tokens in the prompt, those that
  entered the LLM (measured at the LLM's door, :mod:`vitrim.eval.image_tokens`), those the last stage kept
  (``vitrim.vlm.last_selection``), the same three for its videos, each video's frames, frame rates and size
  (:mod:`vitrim.eval.video`) and its tokens, the prefill multiply-adds with the methods and without
  (:mod:`vitrim.eval.prefill_cost`), and the run's settings (methods, every option with its default filled in,
  the positions convention, the processor's pixel settings, the frame sampling, dtype);
- on average, in the results file's ``throughput`` (lmms-eval's ``log_metrics``): ``avg_vitrim_<name>`` for each
  name of :data:`AVERAGED` and ``prefill_macs_ratio`` (means over the samples).

This module imports lmms-eval; ``import vitrim`` never imports it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lmms_eval import utils as lmms_utils
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.models.model_utils.gen_metrics import log_metrics

import vitrim.vlm
from vitrim.eval.image_tokens import PrefillDoor, image_token_id, prompt_counts, video_token_id
from vitrim.eval.inputs import load
from vitrim.eval.model_args import MethodPlan, parse_model_args
from vitrim.eval.prefill_cost import counter_for, sample_macs
from vitrim.eval.video import DECODER, Clip, is_video

DEFAULT_MAX_NEW_TOKENS = 128
AVERAGED = (
    "image_tokens", "image_tokens_entering_llm", "image_tokens_kept",
    "video_tokens", "video_tokens_entering_llm", "video_tokens_kept",
    "prefill_macs", "dense_prefill_macs",
)  # fmt: skip


@dataclass
class SampleCounts(TokenCounts):
    """lmms-eval's per-sample ``TokenCounts`` with vitrim's record (module doc) under ``vitrim``."""

    vitrim: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "vitrim": self.vitrim}


class VitrimModel(lmms):
    """A transformers VLM (or the shipped digits VLM) with vitrim.vlm's methods applied (module doc)."""

    is_simple = True

    def __init__(self, max_batch_size: Any = None, **model_args: Any) -> None:
        super().__init__()
        self.arguments = parse_model_args(model_args)
        self.model, self.prompter = load(self.arguments)
        applied = 0
        try:
            for name, options in self.arguments.plan.methods:
                vitrim.vlm.apply(self.model, name, **options)
                applied += 1
        except BaseException:
            if applied:
                vitrim.vlm.remove(self.model)
            raise
        self.door = PrefillDoor(self.model)
        self.image_id = image_token_id(self.model)
        self.video_id = video_token_id(self.model)
        self.counter = counter_for(self.model)
        self.settings = self._settings()
        self.batch_size = self.arguments.batch_size
        self._rank, self._world_size = 0, 1

    def _settings(self) -> dict[str, Any]:
        """The run's settings recorded with every sample: methods with all their options (defaults filled in),
        the positions convention of each pre-LLM method, the processor's pixel settings, a video's frame sampling
        (models that take video), the dtype."""
        prompter = self.prompter.settings
        video = {"max_num_frames": self.arguments.max_num_frames, "fps": self.arguments.fps, "decoder": DECODER}
        return {
            "model": self.arguments.pretrained,
            **method_settings(self.arguments.plan),
            "processor": prompter.processor,
            "pixels": prompter.pixels,
            **({"video": video} if self.video_id is not None else {}),
            "dtype": prompter.dtype,
            "prefill_macs_counted": self.counter.counted,
        }

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        """Greedy answers to ``requests`` (lmms-eval's simple-model arguments: context, generation settings,
        doc_to_visual, doc_id, task, split), batched (module doc), with their records."""
        return answer_in_batches(self, requests, self._visuals, self._answer)

    def _visuals(self, visuals: Any) -> list[Any]:
        """A request's visuals: pictures as they are, each video as its sampled :class:`~vitrim.eval.video.Clip` (as
        the model's prompter reads it)."""
        read = []
        for visual in as_list(visuals):
            if is_video(visual):
                if self.video_id is None:
                    raise ValueError(
                        f"{type(self.model).__name__} takes no video; the task hands it one ({visual!r:.80})"
                    )
                visual = self.prompter.read_video(visual, self.arguments.max_num_frames, self.arguments.fps)
            read.append(visual)
        return read

    @torch.inference_mode()
    def _answer(
        self, questions: list[str], visuals: list[list[Any]], settings: dict[str, Any]
    ) -> list[GenerationResult]:
        inputs = {
            k: v.to(self.device) if isinstance(v, torch.Tensor) else v
            for k, v in self.prompter.inputs(questions, visuals).items()
        }
        until = settings.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        max_new = int(settings.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        if self.arguments.max_new_tokens is not None:
            max_new = min(max_new, self.arguments.max_new_tokens)
        if float(settings.get("temperature", 0) or 0) > 0 or settings.get("do_sample"):
            raise ValueError("vitrim's lmms-eval model answers greedily; the task asks for sampling (temperature > 0)")
        extra = {} if self.prompter.pad_id is None else {"pad_token_id": self.prompter.pad_id}
        self.door.reset()
        generate: Any = self.model.generate  # transformers' GenerationMixin (typed as a Module attribute)
        generated = generate(**inputs, max_new_tokens=max_new, do_sample=False, **extra)
        new = generated[:, inputs["input_ids"].shape[1] :]
        texts = [cut(text, until) for text in self.prompter.decode(new)]
        return [
            GenerationResult(text, counts)
            for text, counts in zip(texts, self._records(inputs, new, visuals), strict=True)
        ]

    def _records(self, inputs: dict[str, Any], new: torch.Tensor, visuals: list[list[Any]]) -> list[SampleCounts]:
        image, video, text = prompt_counts(
            inputs["input_ids"], inputs.get("attention_mask"), self.image_id, self.video_id
        )
        entered = self.door.rows
        selections = vitrim.vlm.last_selection(self.model) if self.arguments.plan.methods else None
        kept = _kept(visuals, selections, image, video)
        image_grids = iter(_grids(inputs.get("image_grid_thw")))
        video_grids = iter(_grids(inputs.get("video_grid_thw")))
        pad = self.prompter.pad_id
        records = []
        for row, group in enumerate(visuals):
            answer = new[row]
            output = int((answer != pad).sum()) if pad is not None else int(answer.numel())
            clips = [v for v in group if isinstance(v, Clip)]
            pictures = len(group) - len(clips)
            grids = [next(image_grids, None) for _ in range(pictures)]
            clip_grids = [next(video_grids, None) for _ in clips]
            # the grid counted: the first picture's, else the video's (LLaVA-OneVision's processor reports none:
            # its frames' count)
            first = grids[0] if grids else clip_grids[0] if clips else None
            if clips and first is None:
                first = [int(clips[0].frames.shape[0])]
            macs = sample_macs(self.counter, self.arguments.plan, pictures, len(clips), first, text[row])
            # the door sees the image and video tokens together; each kind is known where the sample holds one
            entering = None if entered is None else entered[row] - text[row]
            record = {
                "image_tokens": image[row],
                "image_tokens_entering_llm": 0 if not pictures else entering if not clips else None,
                "image_tokens_kept": kept[row][0],
                "video_tokens": video[row],
                "video_tokens_entering_llm": 0 if not clips else entering if not pictures else None,
                "video_tokens_kept": kept[row][1],
                **(
                    {"videos": [{**c.record(), "grid_thw": g} for c, g in zip(clips, clip_grids, strict=True)]}
                    if clips
                    else {}
                ),
                "text_tokens": text[row],
                "prefill_macs": macs["method"],
                "dense_prefill_macs": macs["dense"],
                "prefill_macs_ratio": macs["ratio"],
                **({"prefill_macs_not_counted": macs["reason"]} if "reason" in macs else {}),
                "settings": self.settings,
            }
            records.append(SampleCounts(input_tokens=image[row] + text[row], output_tokens=output, vitrim=record))
        return records

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError("vitrim's lmms-eval model generates answers (output_type: generate_until) only")

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("vitrim's lmms-eval model answers one round (output_type: generate_until) only")


def answer_in_batches(
    model: lmms,
    requests: list[Instance],
    read_visuals: Callable[[Any], list[Any]],
    answer: Callable[[list[str], list[list[Any]], dict[str, Any]], list[GenerationResult]],
) -> list[GenerationResult]:
    """``requests`` answered ``model.batch_size`` at a time as lmms-eval's own transformers models batch them
    (``Collator``: grouped by generation settings): each request's visuals from its task's ``doc_to_visual``, read by
    ``read_visuals``; ``answer(questions, visuals, settings)`` per batch; the answers in the requests' order, their
    means logged (:func:`log_averages`)."""
    start = time.perf_counter()
    collator = lmms_utils.Collator([request.args for request in requests], lambda args: args[0], grouping=True)
    answers: list[GenerationResult] = []
    for chunk in collator.get_batched(n=model.batch_size, batch_fn=None):
        contexts, all_settings, to_visuals, doc_ids, tasks, splits = zip(*chunk, strict=True)
        visuals = [
            read_visuals(to_visual(model.task_dict[task][split][doc_id]))
            for to_visual, doc_id, task, split in zip(to_visuals, doc_ids, tasks, splits, strict=True)
        ]
        answers.extend(answer(list(contexts), visuals, dict(all_settings[0])))
    ordered = collator.get_original(answers)
    log_averages(ordered, time.perf_counter() - start)
    return ordered


def method_settings(plan: MethodPlan) -> dict[str, Any]:
    """The settings record's methods: ``method`` (``a+b``), each method's ``options`` with its stage and every
    option (defaults filled in), and the ``positions`` convention of each method that has one."""
    options = {}
    for name, given in plan.methods:
        info = vitrim.vlm.method_info(name)
        options[name] = {"stage": info.stage, **jsonable({**info.defaults, **given})}
    positions = {name: o["positions"] for name, o in options.items() if "positions" in o}
    return {"method": plan.described()["method"], "options": options, "positions": positions}


def log_averages(answers: list[GenerationResult], seconds: float) -> None:
    """The run's means into lmms-eval's results file (``throughput``: ``avg_vitrim_<name>``; a mean only where every
    sample has the number)."""
    records = [a.token_counts.vitrim for a in answers if isinstance(a.token_counts, SampleCounts)]
    means: dict[str, float] = {}
    for name in (*AVERAGED, "prefill_macs_ratio"):
        values = [r[name] for r in records if r.get(name) is not None]
        if values and len(values) == len(records):
            means[f"vitrim_{name}"] = statistics.fmean(values)
    generated = sum(a.token_counts.output_tokens or 0 for a in answers if a.token_counts is not None)
    log_metrics(seconds, generated, generated / seconds if seconds > 0 else 0.0, additional_metrics=means)


def as_list(visuals: Any) -> list[Any]:
    return list(visuals) if isinstance(visuals, (list, tuple)) else [visuals]


def _grids(grid_thw: torch.Tensor | None) -> list[list[int]]:
    """The [t, h, w] patch grid of each picture (or video) of the batch, in order (Qwen's processors)."""
    return [] if grid_thw is None else [[int(n) for n in row] for row in grid_thw.tolist()]


def _kept(
    visuals: list[list[Any]], selections: Any, image: list[int], video: list[int]
) -> list[tuple[int | None, int | None]]:
    """Per sample, the (image, video) tokens the last stage kept: ``vitrim.vlm.last_selection``'s entries (one per
    picture or video, in the batch's order) summed per kind; every token where no method is applied."""
    if not selections:
        return list(zip(image, video, strict=True))
    sizes = [len(selection) for selection in selections]
    kept: list[tuple[int | None, int | None]] = []
    at = 0
    for group in visuals:
        mine = sizes[at : at + len(group)] if at + len(group) <= len(sizes) else None
        at += len(group)
        if mine is None:
            kept.append((None, None))
            continue
        pictures_kept = sum(n for n, visual in zip(mine, group, strict=True) if not isinstance(visual, Clip))
        kept.append((pictures_kept, sum(mine) - pictures_kept))
    return kept


def cut(text: str, until: list[str]) -> str:
    """``text`` up to the first of the task's stop strings."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def jsonable(options: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}
