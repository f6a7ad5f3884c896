"""Every method of :mod:`vitrim.vlm` on the digits video model: accuracy per question type, video tokens kept and
prefill speed-up at 50 %, 25 % and 12.5 % of the 64 video tokens.

What a kept fraction f asks of each method (:func:`video_options`), in its own options:

* ``evs``, ``vidcom2``: ``video_pruning_rate = 1 − f`` (vLLM's option and meaning). EVS never keeps fewer than one
  temporal patch's 16 tokens (``max(P, int(t·P·(1 − q)))``), so at 12.5 % it keeps 16 of 64;
* ``temporal_downsample``: ``stride = 1/f`` (2, 4, 8): with 4 temporal patches it keeps 2, 1 and 1 of them;
* ``fastvid``: ``retention_ratio = f``; ``flashvid``: ``retention_ratio = f / expansion`` (its budget per temporal
  patch is ``⌈P·r·expansion⌉``, so the count asked is f of P);
* every image method (``random``, ``visionzip``, ``divprune``, …): ``keep = f``, a fraction of each temporal patch,
  as the video papers run their image baselines; in-LLM methods at the digits LLaVA's layers
  (:data:`vitrim.demos.vlm.sweep.DEMO_OPTIONS`).

The tokens a method kept are measured, not assumed: the mean length of ``vitrim.vlm.last_selection`` over the
timing batch, reported beside the accuracy. A method that refuses the model (``apply`` or its first prefill raises
a ValueError or TypeError: e.g. the tower methods, which Qwen's tower does not take), or that selects nothing in a
video (``last_selection`` empty), is recorded as not run, with its message. Accuracy and timing as
:mod:`vitrim.demos.vlm.sweep`'s: ``generate()`` on every held-out question, prefills of one batch timed in turns
against the unmodified model (:func:`vitrim.bench.timing.interleaved_samples`).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from vitrim.bench.timing import interleaved_samples
from vitrim.demos.video.data import TOKENS_PER_TEMPORAL_PATCH
from vitrim.demos.video.evaluate import HeldOut, score
from vitrim.demos.video.words import VIDEO_TOKENS, processor
from vitrim.demos.vlm.sweep import BASELINE_SEEDS, DEMO_OPTIONS, KEPT_FRACTIONS, SEEDED_BASELINES, demo_options


def video_options(method: str, fraction: str, seed: int | None = None) -> dict[str, Any]:
    """The options the sweep passes ``method`` for a kept ``fraction`` (a key of ``KEPT_FRACTIONS``; module doc), and
    ``seed=`` for a seeded baseline when ``seed`` is given."""
    from vitrim import vlm

    f = float(fraction)
    defaults = vlm.method_info(method).defaults
    if "video_pruning_rate" in defaults:
        options: dict[str, Any] = {"video_pruning_rate": 1.0 - f}
    elif method == "temporal_downsample":
        options = {"stride": round(1 / f)}
    elif method == "flashvid":
        options = {"retention_ratio": f / defaults["expansion"]}
    elif "retention_ratio" in defaults:
        options = {"retention_ratio": f}
    else:  # an image method, per temporal patch: keep= a fraction of each (in-LLM ones at the LLaVA demo's layers)
        options = demo_options(method, f)
    return options | ({} if seed is None else {"seed": seed})


@dataclass
class SweepResult:
    """``methods[name][fraction] = {"accuracy": {type: acc}, "kept_tokens": mean kept of 64, "prefill_speedup": x}``
    (a seeded baseline's accuracy is the mean over ``BASELINE_SEEDS``, each seed's in ``"accuracy_by_seed"``);
    ``options[name][fraction]``: what was passed; ``not_run[name]``: why not."""

    methods: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    options: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)


def available_methods() -> list[str]:
    """Every method of ``vitrim.vlm.methods()`` but FlashVID's in-LLM stage, which follows ``flashvid`` in a stack."""
    from vitrim import vlm

    return [name for name in vlm.methods() if name != "flashvid_llm"]


def check_methods(methods: list[str] | None) -> list[str]:
    """The methods to sweep (None: :func:`available_methods`), checked before any work: one ``ValueError`` naming
    the unknown ones and those the demo takes."""
    known = available_methods()
    if methods is None:
        return known
    if isinstance(methods, str) or not isinstance(methods, list) or not all(isinstance(m, str) for m in methods):
        raise TypeError(f"methods must be a list of method names, got {methods!r:.80}")
    if not methods:
        raise ValueError(f"methods is empty; expected one or more of {known}")
    unknown = [method for method in methods if method not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown} of vitrim.vlm for the video demo; known: {known}")
    return list(dict.fromkeys(methods))


def apply_method(model: nn.Module, method: str, fraction: str, seed: int | None = None) -> nn.Module:
    """A copy of ``model`` with ``method`` applied for ``fraction`` (the model itself is left as it was)."""
    from vitrim import vlm

    return vlm.apply(copy.deepcopy(model), method, **video_options(method, fraction, seed))


@torch.no_grad()
def kept_tokens(pruned: nn.Module, inputs: dict[str, Any]) -> float:
    """The mean count of video tokens entering the LLM per clip of ``inputs`` (``last_selection`` after a prefill)."""
    from vitrim import vlm

    pruned(**inputs)
    kept = vlm.last_selection(pruned)
    if not kept:  # a method that reads image tokens only would leave a video-only prompt as it is
        raise ValueError(
            "it selected no video token (last_selection is empty after a prefill of video prompts): the model ran "
            "unmodified, so its accuracy would be the full model's"
        )
    return statistics.fmean(len(k) for k in kept)


def run_sweep(
    model: nn.Module,
    data: HeldOut,
    methods: list[str],
    *,
    timing_batch: int = 32,
    repeats: int = 3,
    log: Callable[[str], None] | None = None,
) -> SweepResult:
    """Score, count and time every method at every kept fraction (module doc)."""
    result = SweepResult()
    prompts = data.questions[:timing_batch]
    inputs = processor(data.frames[[q.clip for q in prompts]], [q.words for q in prompts])
    for method in methods:
        for fraction in KEPT_FRACTIONS:
            try:
                pruned = apply_method(model, method, fraction)
                kept = kept_tokens(pruned, inputs)
            except (ValueError, TypeError) as err:
                result.not_run[method] = f"{fraction}: {_first_line(err)}"
                result.methods.pop(method, None)
                result.options.pop(method, None)
                break
            accuracy, _ = score(pruned, data)
            full_times, pruned_times = interleaved_samples(
                [partial(m, **inputs) for m in (model, pruned)], repeats, warmup=1
            )
            row: dict[str, Any] = {
                "accuracy": accuracy,
                "kept_tokens": kept,
                "prefill_speedup": statistics.median(full_times) / statistics.median(pruned_times),
            }
            if method in SEEDED_BASELINES:
                by_seed = [accuracy] + [
                    score(apply_method(model, method, fraction, seed), data)[0] for seed in BASELINE_SEEDS[1:]
                ]  # seed 0 is the baseline's default, scored above
                row["accuracy"] = {k: statistics.fmean(one[k] for one in by_seed) for k in accuracy}
                row["accuracy_by_seed"] = by_seed
            result.methods.setdefault(method, {})[fraction] = row
            result.options.setdefault(method, {})[fraction] = video_options(method, fraction)
            if log is not None:
                shown = "  ".join(f"{k} {v:.3f}" for k, v in row["accuracy"].items())
                log(f"  {method:<20} {fraction:<5} kept {kept:5.1f}  {shown}  prefill {row['prefill_speedup']:.2f}x")
    return result


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


__all__ = [
    "DEMO_OPTIONS",
    "KEPT_FRACTIONS",
    "TOKENS_PER_TEMPORAL_PATCH",
    "VIDEO_TOKENS",
    "SweepResult",
    "apply_method",
    "check_methods",
    "run_sweep",
    "video_options",
]
