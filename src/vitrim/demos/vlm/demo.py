"""``vitrim demo vlm``: a LLaVA trained on this machine, questioned, and trimmed by every method of vitrim.vlm.

1. the data (:mod:`vitrim.demos.vlm.data`): canvases of one to three digits and questions "which digit is top
   left ?", "where is the seven ?", "how many digits ?";
2. the model (:mod:`vitrim.demos.vlm.model`): transformers' ``LlavaForConditionalGeneration`` with a small CLIP tower
   and a Llama decoder, trained from scratch by ``--retrain`` (:mod:`vitrim.demos.vlm.train`), or the weights that
   recipe made, shipped in the package;
3. exact match per question type on held-out canvases (held-out digits), of the full model and of every method of
   :mod:`vitrim.vlm` at 50 %, 25 % and 12.5 % of the 64 image tokens, with the measured prefill speed-up;
4. ``summary.json`` (``{"full": {type: acc}, "methods": {method: {fraction: {"accuracy": ..., "prefill_speedup":
   ...}}}}``), ``details.json`` (training record, the methods that did not run and why, the machine's load),
   ``report.md`` and its pictures.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch

from vitrim import untrusted
from vitrim.atomic import atomic_write
from vitrim.demos.vlm.evaluate import HeldOut, held_out, score
from vitrim.demos.vlm.model import CONFIG_FILE, MODEL_FILE, build_model, digits_vlm_config, save_model
from vitrim.demos.vlm.run_folder import load_digits_vlm
from vitrim.demos.vlm.sweep import SweepResult, check_methods, run_sweep
from vitrim.demos.vlm.train import TrainPlan, pretrain_tower, train_model
from vitrim.shipped import copy_run_files, shipped_run

SUMMARY_FILE, DETAILS_FILE, REPORT_FILE = "summary.json", "details.json", "report.md"
SHIPPED_FILES = (MODEL_FILE, CONFIG_FILE, SUMMARY_FILE, DETAILS_FILE)
# what ship_run takes from the float16 weights' own evaluation (the rest of details.json is the training run's)
RESCORED_DETAILS = (
    "full_model_answers",
    "not_run",
    "ink_kept",
    "methods_asked",
    "evaluation_seconds",
    "load_average_at_evaluation",
    "torch_threads_at_evaluation",
    "target_which_at_least_0.95",
)
TARGET_WHICH = 0.95
ANSWERS_RECORDED = 60


@dataclass(frozen=True)
class VLMDemoPlan:
    """Model sizes, training and evaluation of one demo run. ``FULL`` aims at the target; ``QUICK`` checks plumbing."""

    vision: dict[str, Any] = field(default_factory=dict)  # overrides of model.VISION
    text: dict[str, Any] = field(default_factory=dict)  # overrides of model.TEXT
    train: TrainPlan = field(default_factory=lambda: TrainPlan(steps=1500))
    # 600 held-out questions, 200 of each type (one question is 0.5 %): 8 methods at 3 fractions answer them all, and
    # `vitrim demo vlm` should stay near 2 minutes
    test_canvases: int = 200
    timing_batch: int = 32
    repeats: int = 5
    pictures: int = 3
    train_threads: int = 1  # these matrices are too small to share between threads on a loaded 2-core machine


# both token labels (TokenLabels) and 3000 conversation steps: "which" >= 95 % at seeds 0, 1 and 2 (docs/vlm-demo.md)
FULL = VLMDemoPlan(
    train=TrainPlan(
        steps=3000,
        batch_size=32,
        lr=1e-3,
        warmup_steps=50,
        tower_steps=1500,
        tower_augment=True,
        quadrant_weight=1.0,
        digit_weight=1.0,
    )
)
QUICK = VLMDemoPlan(
    vision=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2),
    text=dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1),
    train=TrainPlan(
        steps=3,
        batch_size=8,
        warmup_steps=1,
        canvases_per_epoch=64,
        tower_steps=2,
        tower_batch_size=8,
        tower_augment=True,
    ),
    test_canvases=6,
    timing_batch=6,
    repeats=1,
    pictures=1,
)


def machine_load() -> float | None:
    """The 1-minute load average (None where the OS has none), recorded beside every time the demo measures."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_vlm_demo(
    out: Path,
    plan: VLMDemoPlan,
    *,
    seed: int = 0,
    quiet: bool = False,
    shipped: bool = False,
    methods: list[str] | None = None,
    weights: Path | None = None,
) -> dict[str, Any]:
    """Train (or, with ``shipped``, install the shipped ``FULL`` model), score, sweep the methods, draw and write the
    report to ``out``; returns the summary. ``methods``: which of ``vitrim.vlm.methods()`` (default: all);
    ``weights``: with ``shipped``, the folder holding them (default: the package's own)."""
    if shipped and (plan != FULL or seed != 0):
        raise ValueError(f"the shipped model is the FULL plan at seed 0; seed {seed} and other plans need --retrain")
    chosen = check_methods(methods)  # before training: a typo must not cost a training run
    from vitrim.demos.vlm.report import write_report  # drawing needs matplotlib; the report imports it lazily

    log: Callable[[str], None] | None = None if quiet else (lambda line: print(line, flush=True))
    out.mkdir(parents=True, exist_ok=True)
    model: torch.nn.Module
    if shipped:
        source = shipped_run("vlm") if weights is None else weights
        copy_run_files(source, out, [MODEL_FILE, CONFIG_FILE])
        training = untrusted.read_json(source / DETAILS_FILE)["training"]
        model = load_digits_vlm(out)
    else:
        model, training = _train(plan, seed, log)
        save_model(model, out)
    data = held_out(plan.test_canvases, seed)
    start = time.perf_counter()
    full, answers = score(model, data)
    if log is not None:
        log("full model: " + "  ".join(f"{k} {v:.3f}" for k, v in full.items()))
    sweep = run_sweep(model, data, chosen, timing_batch=plan.timing_batch, repeats=plan.repeats, log=log)
    summary = {"full": full, "methods": sweep.methods}
    details = {
        "weights": "shipped" if shipped else "trained",
        "plan": _plain(asdict(plan)),
        "seed": seed,
        "training": training,
        "held_out": {"canvases": plan.test_canvases, "questions": len(data.questions)},
        "methods_asked": chosen,
        "not_run": sweep.not_run,
        "evaluation_seconds": time.perf_counter() - start,
        "full_model_answers": answers[:ANSWERS_RECORDED],  # the first held-out questions' answers, for a cheap test
        "load_average_at_evaluation": machine_load(),
        "torch_threads_at_evaluation": torch.get_num_threads(),
        "target_which_at_least_0.95": full.get("which", 0.0) >= TARGET_WHICH,
    }
    write_report(out, model, data, summary, details, sweep, answers, pictures=plan.pictures)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    (out / DETAILS_FILE).write_text(json.dumps(details, indent=2) + "\n")
    return summary


def _train(plan: VLMDemoPlan, seed: int, log: Callable[[str], None] | None) -> tuple[torch.nn.Module, dict[str, Any]]:
    build = partial(build_model, digits_vlm_config(plan.vision, plan.text), seed=seed)
    return train_two_stages(build, pretrain_tower, train_model, plan, seed=seed, log=log)


def train_two_stages(
    build: Callable[[], torch.nn.Module],
    pretrain: Callable[..., dict[str, float]],
    train: Callable[..., dict[str, float]],
    plan: Any,
    *,
    seed: int,
    log: Callable[[str], None] | None,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Both digits demos' training run: ``build()`` the model, then ``pretrain`` (stage 1, the tower) and ``train``
    (stage 2), each called ``(model, plan.train, seed=, log=)``, on ``plan.train_threads`` threads (torch's own
    restored after). Returns the model and its record: seconds, stage 1's (``tower_seconds`` and its other numbers
    as ``tower_<name>``), stage 2's last loss, threads, the load average before and after, parameters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(plan.train_threads or threads)
    try:
        model = build()
        load_before = machine_load()
        tower = pretrain(model, plan.train, seed=seed, log=log)
        result = train(model, plan.train, seed=seed, log=log)
        record = {
            "seconds": tower["seconds"] + result["seconds"],
            "tower_seconds": tower["seconds"],
            **{f"tower_{name}": value for name, value in tower.items() if name != "seconds"},
            "final_loss": result["loss"],
            "threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": machine_load(),
            "parameters": sum(p.numel() for p in model.parameters()),
        }
    finally:
        torch.set_num_threads(threads)
    return model, record


def ship_run(out: Path, dest: Path, methods: list[str] | None = None) -> None:
    """Copy a demo run that trained the ``FULL`` plan to ``dest`` as the shipped weights (float16), with the summary
    of those float16 weights: they are scored again (into ``out/as_shipped``), since storing them in float16 moves a
    few answers of the trimmed models, and the docs quote what ``vitrim demo vlm`` on them gives."""
    details_file = out / DETAILS_FILE
    details = untrusted.read_json(details_file) if details_file.is_file() else {}
    if details.get("weights") != "trained" or recipe(details.get("plan", {})) != recipe(_plain(asdict(FULL))):
        raise ValueError(f"{str(out)!r} is not a run that trained the FULL plan (vitrim demo vlm --retrain)")
    trained = untrusted.read_json(out / SUMMARY_FILE)
    copy_run_files(out, dest, list(SHIPPED_FILES), float16=True)
    rescored = out / "as_shipped"
    summary = run_vlm_demo(rescored, FULL, quiet=True, shipped=True, methods=methods, weights=dest)
    scored = untrusted.read_json(rescored / DETAILS_FILE)
    details.update({key: scored[key] for key in RESCORED_DETAILS})
    details["summary_of"] = "the shipped float16 weights (vitrim demo vlm on them)"
    details["full_when_trained"] = trained["full"]
    atomic_write(dest / SUMMARY_FILE, partial(_write_json, summary))
    atomic_write(dest / DETAILS_FILE, partial(_write_json, details))


def _write_json(value: object, path: Path) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def recipe(plan: dict[str, Any]) -> dict[str, Any]:
    """What of a plan (as details.json stores it) makes the weights: sizes and training, not the evaluation. A
    ``TrainPlan`` field the record lacks was not there when it was written: the run had its default."""
    made = {key: plan.get(key) for key in ("vision", "text", "train", "train_threads")}
    if isinstance(made["train"], dict):
        defaults = {f.name: f.default for f in fields(TrainPlan) if f.default is not MISSING}
        made["train"] = {**_plain(defaults), **made["train"]}
    return made


def _plain(value: object) -> Any:
    return json.loads(json.dumps(value))  # tuples -> lists, as JSON stores them


__all__ = ["FULL", "QUICK", "HeldOut", "SweepResult", "VLMDemoPlan", "run_vlm_demo", "ship_run"]
