"""Every method of :mod:`vitrim.vlm` on the digits VLM: accuracy per question type and prefill speed-up per keep.

For each method and kept fraction (``KEPT_FRACTIONS`` of the 64 image tokens), a copy of the model gets
``vitrim.vlm.apply(copy, method, **method_options(method, fraction))``; the copy answers every held-out
question through ``generate()``, and the prefill of one batch of prompts is timed against the unmodified model in
turns (:func:`vitrim.bench.timing.interleaved_samples`), so that the ratio of the medians is measured under the same
load. A method that refuses the demo model (``apply`` raises a ValueError or TypeError) is recorded as not run,
with its message: the report lists it as such and never fills in a number.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from torch import nn

from vitrim.bench.timing import interleaved_samples
from vitrim.demos.vlm.evaluate import HeldOut, score
from vitrim.demos.vlm.words import IMAGE_TOKENS, processor

KEPT_FRACTIONS = ("0.5", "0.25", "0.125")  # the summary's keys; float() of each is the `keep=` passed
# The decoder has 4 layers (the papers' LLaMA-7B: 32): staged and layer-K methods get the same depths, scaled; the
# tower has 4 too (CLIP-L: 24), and HiPrune's object layer is scaled alike.
DEMO_OPTIONS: dict[str, dict[str, Any]] = {
    "fastv": {"layer": 2},  # the authors' K = 2 (of 32 layers); here the last 2 of 4 layers run on the kept tokens
    "dart": {"layer": 2},
    "pdrop": {"layers": (1, 2, 3)},  # PyramidDrop's stages at 8/16/24 of 32 layers: a quarter, half, 3/4 deep
    "hiprune": {"object_layer": 2},  # the authors' layer 9 of CLIP-L's 24: a middle layer of the tower's 4
    "flashvid_llm": {"layer": 2},  # as FastV's K (the authors' 20 of Qwen2.5-VL's 28 would leave no layer here)
}


# The random baselines are scored at each of these seeds (their `seed=` option) and reported as the mean, with the
# accuracy of each seed beside it: one draw is luck (issue 44: which@8 ranged 37-44 % over five seeds).
BASELINE_SEEDS = (0, 1, 2, 3, 4)
SEEDED_BASELINES = ("random", "tower_random")


def method_options(method: str, fraction: str, seed: int | None = None) -> dict[str, Any]:
    """The options the sweep passes for a kept ``fraction`` (a key of ``KEPT_FRACTIONS``): :func:`demo_options`,
    and ``seed=`` for a seeded baseline when ``seed`` is given (its own default otherwise)."""
    return demo_options(method, float(fraction)) | ({} if seed is None else {"seed": seed})


def demo_options(method: str, keep: float) -> dict[str, Any]:
    """The options the demo passes ``method`` asked to keep ``keep`` image tokens (a count, or a fraction of the 64 as
    a float): ``keep=`` and DEMO_OPTIONS; PyramidDrop, which takes no ``keep``, gets its geometric halving with the
    middle stage at the kept fraction f: ``ratios=(2f, f, f/2)`` (the authors' (0.5, 0.25, 0.125) is f = 0.25), and
    FlashVID's in-LLM stage ``llm_retention_ratio=f``."""
    if method == "pdrop":
        f = keep / IMAGE_TOKENS if isinstance(keep, int) else keep
        return {**DEMO_OPTIONS[method], "ratios": (min(1.0, 2 * f), f, f / 2)}
    if method == "flashvid_llm":  # its count is a share of the image's tokens, ⌈N·r⌉, not keep=
        return {**DEMO_OPTIONS[method], "llm_retention_ratio": keep / IMAGE_TOKENS if isinstance(keep, int) else keep}
    return {"keep": keep, **DEMO_OPTIONS.get(method, {})}


@dataclass
class SweepResult:
    """``methods[name][fraction] = {"accuracy": {type: acc}, "prefill_speedup": x}`` (a seeded baseline's accuracy is
    the mean over ``BASELINE_SEEDS``, each seed's in ``"accuracy_by_seed"``); ``not_run[name]``: why not;
    ``answers[name][fraction]``: the answers (held-out question order), for the report's examples."""

    methods: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)
    answers: dict[str, dict[str, list[str]]] = field(default_factory=dict)


def available_methods() -> list[str]:
    """The image methods of ``vitrim.vlm.methods()`` (the digits VLM sees pictures; a video method refuses it), or []
    where vitrim.vlm is not there yet (the report then says no method ran)."""
    try:
        from vitrim import vlm
    except ImportError:
        return []
    return [name for name in vlm.methods() if not vlm.method_info(name).video]


def _video_methods() -> list[str]:
    from vitrim import vlm

    return [name for name in vlm.methods() if vlm.method_info(name).video]


def check_methods(methods: list[str] | None) -> list[str]:
    """The methods to sweep (None: every image method), each an image method of :mod:`vitrim.vlm`, checked before
    any training: ``ValueError`` naming the unknown ones (or the video ones) and those the demo takes."""
    known = available_methods()
    if methods is None:
        return known
    if isinstance(methods, str) or not isinstance(methods, list) or not all(isinstance(m, str) for m in methods):
        raise TypeError(f"methods must be a list of method names, got {methods!r:.80}")
    if not methods:
        raise ValueError(f"methods is empty; expected one or more of {known}")
    unknown = [method for method in methods if method not in known]
    video = [method for method in unknown if method in _video_methods()]
    if video:
        raise ValueError(f"method(s) {video} reduce videos, and the digits VLM sees pictures; it takes: {known}")
    if unknown:
        raise ValueError(f"unknown method(s) {unknown} of vitrim.vlm; known: {known}")
    return list(dict.fromkeys(methods))


def apply_method(model: nn.Module, method: str, fraction: str, seed: int | None = None) -> nn.Module:
    """A copy of ``model`` with ``method`` applied at ``keep=float(fraction)`` (the model itself is left as it was);
    ``seed``: a seeded baseline's seed."""
    from vitrim import vlm

    return vlm.apply(copy.deepcopy(model), method, **method_options(method, fraction, seed))


def baseline_accuracy(
    model: nn.Module, method: str, fraction: str, data: HeldOut, known: dict[int, dict[str, float]] | None = None
) -> dict[str, Any]:
    """A seeded baseline scored at every seed of ``BASELINE_SEEDS``: ``{"accuracy": {type: mean over the seeds},
    "accuracy_by_seed": [{type: accuracy} per seed]}``; ``known``: the accuracy of seeds already scored."""
    known = known or {}
    by_seed = [
        known[seed] if seed in known else score(apply_method(model, method, fraction, seed), data)[0]
        for seed in BASELINE_SEEDS
    ]
    mean = {kind: statistics.fmean(one[kind] for one in by_seed) for kind in by_seed[0]}
    return {"accuracy": mean, "accuracy_by_seed": by_seed}


def run_sweep(
    model: nn.Module,
    data: HeldOut,
    methods: list[str],
    *,
    timing_batch: int = 64,
    repeats: int = 7,
    log: Callable[[str], None] | None = None,
) -> SweepResult:
    """Score and time every method at every kept fraction (module doc)."""
    result = SweepResult()
    prompts = data.questions[:timing_batch]
    timing_inputs = processor(data.pixels[[q.canvas for q in prompts]], [q.words for q in prompts])
    for method in methods:
        for fraction in KEPT_FRACTIONS:
            try:
                pruned = apply_method(model, method, fraction)
            except (ValueError, TypeError) as err:
                result.not_run[method] = f"keep={fraction}: {err}"
                result.methods.pop(method, None)
                break
            accuracy, answers = score(pruned, data)
            full_times, pruned_times = interleaved_samples(
                _prefills(model, pruned, inputs=timing_inputs), repeats, warmup=1
            )
            speedup = statistics.median(full_times) / statistics.median(pruned_times)
            row: dict[str, Any] = {"accuracy": accuracy, "prefill_speedup": speedup}
            if method in SEEDED_BASELINES:  # the mean of its seeds (the answers shown stay the default seed's)
                seeded = baseline_accuracy(model, method, fraction, data, known={0: accuracy})  # 0: their default
                row = {**seeded, "prefill_speedup": speedup}
                accuracy = row["accuracy"]
            result.methods.setdefault(method, {})[fraction] = row
            result.answers.setdefault(method, {})[fraction] = answers
            if log is not None:
                shown = "  ".join(f"{k} {v:.3f}" for k, v in accuracy.items())
                log(f"  {method:<12} keep {fraction:<5}  {shown}  prefill {speedup:.2f}x")
    return result


def _prefills(*models: nn.Module, inputs: dict[str, Any]) -> list[Callable[[], object]]:
    return [partial(m, **inputs) for m in models]


def kept_selection(model: nn.Module, method: str, fraction: str, pixels: np.ndarray, question: Any) -> Any:
    """One prefill of ``question`` on its canvas (pixels: (64, 64)) with ``method`` applied: the groups of image-token
    indices entering the LLM (``vitrim.vlm.last_selection(groups=True)`` of that one image)."""
    from vitrim import vlm

    pruned = apply_method(model, method, fraction)
    pruned(**processor(pixels[None], [question.words]))
    return vlm.last_selection(pruned, groups=True)[0]
