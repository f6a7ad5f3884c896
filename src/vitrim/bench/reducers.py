"""``vitrim bench reducers``: every registered token reducer at matched FLOPs, timed against dense in one run.

For each model and each compute target, every reducer that declares a strength option
(:class:`~vitrim.reduce.base.StrengthOption`) is tuned to the FLOPs closest to the target
(:mod:`vitrim.bench.matched`), at its own default blocks. A reducer that declares none but follows per-block
schedules (DiffRate) runs, for each target, the schedule preset (:mod:`vitrim.reduce.schedule`) searched for a model
of this shape (depth, tokens, width) whose FLOPs come closest to the target, if one lies within ``PRESET_TOLERANCE``
of it. Reducers
that have neither, or that refuse the model (a [CLS]-ranking reducer on a model without [CLS]), are listed as
skipped with the reason. Then:

* speed: every row (dense first) is timed in turns within each repeat (with ``optimize``, each row is first
  compiled by :func:`vitrim.optimize` for each batch size, dense included, so both sides of a ratio are compiled)
  (:func:`~vitrim.bench.timing.interleaved_samples`), float32, eval, ``torch.inference_mode``, on random images, at
  each batch size: images/s from the median time, speed-up = the median over repeats of (dense time / row time) in
  the same repeat (paired, so a change of load on a shared machine hits both sides of each ratio);
* accuracy (optional): on a trained classifier (the demo's dense digits ViT), each reducer is tuned again to the
  same *fraction* of that model's dense FLOPs as the row's target is of its own model's, and its top-1 off the shelf (no
  retraining) on the run's held-out split is reported with the drop against the dense top-1. Learned reducers
  (those that add modules, e.g. DynamicViT's predictors) get no accuracy: their modules are untrained here, nor do
  schedule presets, whose token counts fit only the model they were searched for.

Units: targets and the GMACs column count multiply-adds (1e9 per GMAC), which is what the papers call "GFLOPs"
(fvcore's count: DeiT-S/16 at 224 is 4.6); ``vitrim bench models`` counts 2 FLOPs per multiply-add.
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitrim import reduce
from vitrim.bench.flops import model_flops_per_image
from vitrim.bench.matched import Match, match_reducer, reducer_flops
from vitrim.bench.timing import interleaved_samples
from vitrim.factory import create_model
from vitrim.optimize import optimize
from vitrim.reduce.schedule import SCHEDULES
from vitrim.train.checkpoint_eval import load_checkpoint_split
from vitrim.train.evaluate import evaluate
from vitrim.train.loop import input_spec

FLOPS_PER_GMAC = 2e9  # FLOPs (2 per multiply-add, vitrim's count) in one GMAC (the papers' "GFLOP")
PRESET_TOLERANCE = 0.05  # a schedule preset stands in for a target only within 5 % of its FLOPs


@dataclass(frozen=True)
class Target:
    """A compute target: ``value`` GMACs, or (``relative``) that fraction of each model's dense GMACs."""

    value: float
    relative: bool = False

    def flops(self, dense_flops: float) -> float:
        """The target in FLOPs per image for a model whose dense count is ``dense_flops``."""
        return self.value * dense_flops if self.relative else self.value * FLOPS_PER_GMAC

    @property
    def label(self) -> str:
        return f"{100 * self.value:g}%" if self.relative else f"{self.value:g}"


def parse_targets(text: str) -> tuple[Target, ...]:
    """``"2.9,2.6"`` (GMACs) or ``"63%,56%"`` (of each model's dense GMACs), or a mix -> targets."""
    targets = []
    for item in str(text).split(","):
        item = item.strip()
        relative = item.endswith("%")
        try:
            value = float(item[:-1] if relative else item)
        except ValueError:
            expected = "comma-separated GMACs (2.9) or percentages (63%)"
            raise ValueError(f"--targets must be {expected}, got {text!r}") from None
        if not (value > 0 and value < float("inf")):
            raise ValueError(f"--targets must be positive, got {item!r} in {text!r}")
        if relative and value > 100:
            raise ValueError(f"--targets {item!r} is above 100% of dense")
        targets.append(Target(value / 100 if relative else value, relative))
    return tuple(targets)


@dataclass(frozen=True)
class ReducerBenchSettings:
    """What ``vitrim bench reducers`` measures (its options)."""

    targets: tuple[Target, ...] = (Target(2.9), Target(2.6))
    batch_sizes: tuple[int, ...] = (1, 32)
    repeats: tuple[int, ...] = (10,)  # timed calls per row (median): one count, or one per batch size
    warmup: int = 2  # untimed calls per row and batch size
    img_size: int | None = None  # None: each model's own
    overrides: dict[str, Any] = field(default_factory=dict)  # create_model keywords for every model (--set)
    optimize: bool = False  # time every row through vitrim.optimize (one graph per batch size), dense included

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("--targets must name at least one target")
        for name, values in (("--batch-sizes", self.batch_sizes), ("--repeats", self.repeats)):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values):
                raise ValueError(f"{name} must be positive ints, got {list(values)}")
        if len(self.repeats) not in (1, len(self.batch_sizes)):
            raise ValueError(
                f"--repeats must be one count or one per batch size ({len(self.batch_sizes)}), got {list(self.repeats)}"
            )
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"--warmup must be an int >= 0, got {self.warmup!r}")
        if self.img_size is not None and self.img_size <= 0:
            raise ValueError(f"--img-size must be a positive int, got {self.img_size}")

    @property
    def repeats_per_batch(self) -> tuple[int, ...]:
        """The repeat count of each batch size."""
        return self.repeats * len(self.batch_sizes) if len(self.repeats) == 1 else self.repeats


def tunable_reducers() -> tuple[list[str], list[str], list[dict[str, str | None]]]:
    """Registered reducers that declare a strength option; those that instead follow schedule presets; the others
    as skipped entries with the reason."""
    tunable, scheduled, skipped = [], [], []
    for name in reduce.list_reducers():
        cls = reduce.get_reducer(name)
        if cls.strength_option is not None:
            tunable.append(name)
        elif cls.takes_schedule():
            scheduled.append(name)
        else:
            reason = "declares no strength_option (the one numeric option to tune; vitrim.reduce.StrengthOption)"
            skipped.append({"method": name, "model": None, "reason": reason})
    return tunable, scheduled, skipped


def nearest_preset(model: nn.Module, name: str, target: float, img_size: tuple[int, int]) -> tuple[str, float] | None:
    """The schedule preset searched for a model of ``model``'s shape (depth, token count, width) with which reducer
    ``name`` comes closest to ``target`` FLOPs, and its FLOPs; None if no preset was searched for this shape or none
    lies within ``PRESET_TOLERANCE`` of the target. (A preset runs on any model with its depth and token count, but
    one searched for DeiT-B is not DiffRate's answer for DeiT-S.)"""
    width = getattr(getattr(model, "config", None), "embed_dim", None)
    counted = []
    for preset, schedule in SCHEDULES.items():
        try:
            schedule.check(model)
        except ValueError:
            continue  # another depth or token count: the counts do not apply
        if schedule.embed_dim != width:
            continue
        counted.append((preset, reducer_flops(model, name, {"schedule": preset}, img_size)))
    if not counted:
        return None
    preset, flops = min(counted, key=lambda pf: abs(pf[1] - target))
    return (preset, flops) if abs(flops - target) <= PRESET_TOLERANCE * target else None


def is_learned(name: str) -> bool:
    """Whether reducer ``name`` adds modules to the model (they need training: no off-the-shelf accuracy)."""
    return bool(reduce.get_reducer(name).adds_modules)


def strength(name: str, value: float) -> dict[str, Any]:
    """``{"r": 13}``: the options that set reducer ``name``'s strength option to ``value``."""
    option = reduce.get_reducer(name).strength_option
    assert option is not None
    return {option.name: value}


def setting(options: dict[str, Any]) -> str:
    """``"r=13"``, ``"keep_rate=0.652"``, ``"schedule=diffrate_deit_s_2.9"``: a row's options as text."""
    return ",".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in options.items())


def with_reducer(model: nn.Module, name: str | None, options: dict[str, Any]) -> nn.Module:
    """A copy of ``model`` (eval) with reducer ``name`` and ``options``; the model itself for dense (None)."""
    if name is None:
        return model
    return reduce.apply(copy.deepcopy(model), name, **options).eval()


def image_size(model: nn.Module) -> tuple[int, int]:
    """(H, W) the model was built for."""
    return input_spec(model)[0]


# -- accuracy ---------------------------------------------------------------------------------------------------


class AccuracyModel:
    """A trained classifier and its run's held-out split: top-1 off the shelf with a reducer at a FLOP fraction.

    ``path``: a run folder (its ``last.safetensors``, as ``vitrim demo`` and ``vitrim train`` write) or a checkpoint.
    """

    def __init__(self, path: str | Path) -> None:
        checkpoint = Path(path)
        if checkpoint.is_dir():
            checkpoint = checkpoint / "last.safetensors"
        if not checkpoint.is_file():
            raise FileNotFoundError(f"--accuracy-model {str(path)!r}: no checkpoint (a run folder or a .safetensors)")
        loaded = load_checkpoint_split(checkpoint)
        self.checkpoint = str(checkpoint)
        self.model = loaded.model.eval()
        self.dataset = loaded.dataset
        self.num_classes = loaded.num_classes
        self.data = loaded.data
        self.img_size = image_size(self.model)
        self.dense_flops = model_flops_per_image(self.model, self.img_size, input_spec(self.model)[1])
        self.dense_top1 = self.top1(self.model)
        self._matches: dict[tuple[str, float], Match] = {}
        self._counted: dict[str, dict[float, float]] = {}

    def top1(self, model: nn.Module) -> float:
        """Top-1 of ``model`` on the held-out split."""
        return float(evaluate(model, self.dataset, num_classes=self.num_classes, batch_size=256)["top1"])

    def at_fraction(self, name: str, fraction: float) -> dict[str, Any]:
        """Reducer ``name`` tuned to ``fraction`` of this model's dense FLOPs: its setting, GMACs and top-1."""
        if is_learned(name):
            return {"note": "learned (its modules are untrained here)"}
        if reduce.get_reducer(name).strength_option is None:
            return {"note": "schedule presets fit only the model they were searched for"}
        key = (name, round(fraction, 12))
        try:
            if key not in self._matches:
                counted = self._counted.setdefault(name, {})
                target = fraction * self.dense_flops
                self._matches[key] = match_reducer(self.model, name, [target], self.img_size, counted)[0]
        except ValueError as err:
            return {"note": f"refused by the accuracy model: {err}"}
        match = self._matches[key]
        options = strength(name, match.value)
        top1 = self.top1(with_reducer(self.model, name, options))
        return {
            "setting": setting(options),
            "value": match.value,
            "gmacs": match.flops / FLOPS_PER_GMAC,
            "fraction_of_dense": match.flops / self.dense_flops,
            "reachable": match.reachable,
            "top1": top1,
            "drop_points": 100 * (self.dense_top1 - top1),
        }

    def describe(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "data": self.data,
            "test_images": len(self.dataset),  # type: ignore[arg-type]
            "img_size": list(self.img_size),
            "dense_gmacs": self.dense_flops / FLOPS_PER_GMAC,
            "dense_top1": self.dense_top1,
        }


# -- the benchmark ----------------------------------------------------------------------------------------------


def build(name: str, settings: ReducerBenchSettings) -> nn.Module:
    """Registered model ``name`` with the shared overrides and image size, in eval mode."""
    kwargs = dict(settings.overrides)
    if settings.img_size is not None:
        if "img_size" in kwargs:
            raise ValueError("give the image size once: --img-size or --set img_size=..., not both")
        kwargs["img_size"] = settings.img_size
    return create_model(name, **kwargs).eval()


def check_targets(name: str, dense_flops: float, targets: Sequence[Target]) -> None:
    """Every target must lie at or below the model's dense FLOPs (a reducer cannot add compute)."""
    for target in targets:
        if target.flops(dense_flops) > dense_flops * (1 + 1e-9):
            raise ValueError(
                f"--targets {target.label} GMACs is above the dense count of {name} "
                f"({dense_flops / FLOPS_PER_GMAC:.4g} GMACs); give targets at or below it (or as a percentage)"
            )


def paired_speedup(base: Sequence[float], times: Sequence[float]) -> float:
    """The median over repeats of base time / row time, each ratio from the same repeat (same machine load)."""
    if len(base) != len(times) or not base:
        raise ValueError(f"paired timings need equal, non-empty lists, got {len(base)} and {len(times)}")
    return statistics.median(b / t for b, t in zip(base, times))


def time_rows(models: Sequence[Any], images: Tensor, repeats: int, warmup: int) -> list[dict[str, float]]:
    """Images/s, median ms and paired speed-up over ``models[0]`` of each model on ``images`` (B, C, H, W)."""
    samples = interleaved_samples([functools.partial(m, images) for m in models], repeats, warmup)
    batch = images.shape[0]
    return [
        {
            "img_s": batch / statistics.median(times),
            "median_ms": 1e3 * statistics.median(times),
            "speedup": paired_speedup(samples[0], times),
        }
        for times in samples
    ]


def bench_reducers(
    model_names: Sequence[str], settings: ReducerBenchSettings, accuracy: AccuracyModel | None = None
) -> dict[str, Any]:
    """Run the benchmark (module doc) and return ``{"rows", "skipped", "models", "accuracy_model"}``.

    Every model is built and every target checked before anything is tuned or timed.
    """
    if not model_names:
        raise ValueError("--models must name at least one model")
    models = {name: build(name, settings) for name in model_names}
    dense: dict[str, float] = {}
    for name, model in models.items():
        dense[name] = model_flops_per_image(model, image_size(model), input_spec(model)[1])
        check_targets(name, dense[name], settings.targets)
    tunable, scheduled, skipped = tunable_reducers()
    rows: list[dict[str, Any]] = []
    for name, model in models.items():
        hw = image_size(model)
        targets = [t.flops(dense[name]) for t in settings.targets]
        model_rows = [_row(name, hw, dense[name], None, None, {}, dense[name])]
        for method in tunable:
            _progress(f"{name}: tuning {method}")
            try:
                matches = match_reducer(model, method, targets, hw)
            except ValueError as err:
                skipped.append({"method": method, "model": name, "reason": f"refused: {err}"})
                continue
            model_rows += [
                _row(name, hw, dense[name], method, t, strength(method, m.value), m.flops, m.reachable)
                for t, m in zip(settings.targets, matches)
            ]
        for method in scheduled:
            _progress(f"{name}: {method}'s schedule presets")
            for target, flops in zip(settings.targets, targets):
                found = nearest_preset(model, method, flops, hw)
                if found is None:
                    reason = f"no schedule preset for this model within {PRESET_TOLERANCE:.0%} of {target.label}"
                    skipped.append({"method": method, "model": name, "reason": reason})
                    continue
                preset, preset_flops = found
                model_rows.append(_row(name, hw, dense[name], method, target, {"schedule": preset}, preset_flops))
        runners = [with_reducer(model, _method(r), r["options"]) for r in model_rows]
        chans = input_spec(model)[1]
        for batch, repeats in zip(settings.batch_sizes, settings.repeats_per_batch):
            _progress(f"{name}: timing {len(runners)} rows at batch {batch}, {repeats} repeats")
            images = torch.randn(batch, chans, *hw, generator=torch.Generator().manual_seed(0))
            timed: Sequence[Any] = runners
            warmup = settings.warmup
            if settings.optimize:  # one graph per row and batch size, compiled during the first warm-up call
                timed, warmup = [optimize(r, batch_size=batch, img_size=hw) for r in runners], max(warmup, 1)
            for row, speed in zip(model_rows, time_rows(timed, images, repeats, warmup)):
                row["speed"][str(batch)] = speed
        if accuracy is not None:
            for row in model_rows:
                if row["method"] == "dense":
                    row["accuracy"] = {"gmacs": accuracy.dense_flops / FLOPS_PER_GMAC, "top1": accuracy.dense_top1}
                else:
                    _progress(f"accuracy: {row['method']} at {row['target_fraction']:.3f} of dense")
                    row["accuracy"] = accuracy.at_fraction(row["method"], row["target_fraction"])
        rows += model_rows
    return {
        "rows": rows,
        "skipped": skipped,
        "models": {
            name: {"img_size": list(image_size(m)), "dense_gmacs": dense[name] / FLOPS_PER_GMAC}
            for name, m in models.items()
        },
        "accuracy_model": None if accuracy is None else accuracy.describe(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _row(
    model: str,
    hw: tuple[int, int],
    dense_flops: float,
    method: str | None,
    target: Target | None,
    options: dict[str, Any],
    flops: float,
    reachable: bool = True,
) -> dict[str, Any]:
    """One table row: ``method`` (None: dense) with ``options`` on ``model``, at ``flops`` per image."""
    option = None if method is None else reduce.get_reducer(method).strength_option
    return {
        "model": model,
        "img_size": list(hw),
        "method": "dense" if method is None else method,
        "setting": setting(options) or "-",
        "options": options,
        "value": None if option is None else options[option.name],  # the strength option's value
        "target": None if target is None else target.label,
        "target_gmacs": None if target is None else target.flops(dense_flops) / FLOPS_PER_GMAC,
        "target_fraction": None if target is None else target.flops(dense_flops) / dense_flops,
        "gmacs": flops / FLOPS_PER_GMAC,
        "flops": flops,
        "fraction_of_dense": flops / dense_flops,
        "reachable": reachable,
        "learned": False if method is None else is_learned(method),
        "speed": {},
        "accuracy": None,
    }


def _method(row: dict[str, Any]) -> str | None:
    return None if row["method"] == "dense" else row["method"]


def _progress(message: str) -> None:
    print(f"[bench reducers] {message}", file=sys.stderr, flush=True)
