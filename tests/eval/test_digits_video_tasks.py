"""The video digits tasks under ``lmms-eval --model vitrim``: the digits video model's held-out clips read from disk,
scored by lmms-eval's exact match, equal to the video demo's own scorer.

The reference is independent of the code under test: :func:`vitrim.demos.video.evaluate.score` (``model.generate``
with the demo's processor on the demo's clips, 100 questions a batch) on the model the sweep makes
(:func:`vitrim.demos.video.sweep.apply_method`), and the sweep's own count of the tokens kept
(:func:`~vitrim.demos.video.sweep.kept_tokens`). Under ``-m full``: the demo's whole table, the shipped
``summary.json`` (what ``vitrim demo video`` prints), out of lmms-eval.
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmms_eval")

import numpy as np
from lmms_eval.evaluator import simple_evaluate
from lmms_eval.tasks import TaskManager

from vitrim.demos.video.data import QUESTION_TYPES
from vitrim.eval.digits_tasks import VIDEO_DATA_FOLDER, VIDEO_QUESTION_TYPES, video_task_name
from vitrim.eval.lmms_model import VitrimModel

DENSE = "1"  # the fraction the dense model keeps (no method)


def evaluate(model: VitrimModel, manager: TaskManager, limit: int | None = None) -> dict[str, Any]:
    tasks = [video_task_name(kind) for kind in QUESTION_TYPES]
    return simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=limit, log_samples=True)


def answers(results: dict[str, Any], kind: str) -> list[str]:
    by_doc = {s["doc_id"]: s["resps"][0][0] for s in results["samples"][video_task_name(kind)]}
    return [by_doc[i] for i in range(len(by_doc))]


def records(results: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    samples = sorted(results["samples"][video_task_name(kind)], key=lambda s: s["doc_id"])
    return [s["token_counts"][0]["vitrim"] for s in samples]


def demo_model(method: str, fraction: str, seed: int | None = None) -> Any:
    """The shipped digits video model as the demo loads it, with ``method`` applied as its sweep applies it."""
    from vitrim.demos.video.run_folder import load_video_model
    from vitrim.demos.video.sweep import apply_method
    from vitrim.shipped import shipped_run

    model = load_video_model(shipped_run("video"))
    return model if method == "none" else apply_method(model, method, fraction, seed)


def lmms_model(method: str, fraction: str, batch_size: int, seed: int | None = None) -> VitrimModel:
    """``--model vitrim --model_args pretrained=digits_video,method=...`` with the sweep's options for ``fraction``."""
    from vitrim.demos.video.sweep import video_options

    options = {} if method == "none" else video_options(method, fraction, seed)
    return VitrimModel(pretrained="digits_video", batch_size=batch_size, method=method, **options)


def test_the_tasks_ask_the_demos_question_types() -> None:
    assert VIDEO_QUESTION_TYPES == QUESTION_TYPES


def test_a_clip_reaches_the_model_exactly(digits_video_tasks: Path, clips: int) -> None:
    """``doc_to_video`` of every row, read by the digits video prompter, is the demo's float32 clip bit for bit."""
    import datasets
    from vitrim.demos.video.evaluate import held_out
    from vitrim.eval.inputs import DigitsVideoPrompter

    spec = importlib.util.spec_from_file_location("digits_video_utils", digits_video_tasks / "utils.py")
    assert spec is not None and spec.loader is not None
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    data = datasets.load_from_disk(str(digits_video_tasks / VIDEO_DATA_FOLDER))
    frames = held_out(clips).frames
    prompter = DigitsVideoPrompter()
    for kind in QUESTION_TYPES:
        assert len(data[kind]) == clips
        for doc in data[kind]:
            [video] = utils.doc_to_video(doc)  # one video: a list of 8 mode-"F" frames
            assert len(video) == 8 and all(frame.mode == "F" for frame in video)
            clip = prompter.read_video(video, max_num_frames=32, fps=None)
            assert clip.frames.dtype == np.float32
            assert np.array_equal(clip.frames, frames[doc["clip"]])


# EVS (a video method) at the demo's 50 % and DivPrune on each temporal patch (an image method) at 25 %: on the first
# 8 clips each answers some questions wrong, with varied answers (EVS at 25 % answers the first 6 clips alike)
@pytest.mark.parametrize(("method", "fraction"), [("none", DENSE), ("evs", "0.5"), ("divprune", "0.25")])
def test_video_digits_tasks_score_what_the_demo_scores(
    task_manager: TaskManager, clips: int, method: str, fraction: str
) -> None:
    """lmms-eval's exact match on the video digits tasks equals the video demo's accuracy per question type, answer
    for answer, for the dense model and a method as the demo's sweep applies it; lmms-eval's batches of 4 answer and
    record as batches of 1; the video tokens kept are the sweep's count."""
    from vitrim.demos.video.evaluate import held_out, score
    from vitrim.demos.video.sweep import kept_tokens
    from vitrim.demos.video.words import processor

    batched = evaluate(lmms_model(method, fraction, batch_size=4), task_manager)
    alone = evaluate(lmms_model(method, fraction, batch_size=1), task_manager)
    reference = demo_model(method, fraction)
    data = held_out(clips)
    accuracy, demo_answers = score(reference, data)
    for kind in QUESTION_TYPES:
        theirs = [a for q, a in zip(data.questions, demo_answers, strict=True) if q.kind == kind]
        assert answers(batched, kind) == theirs
        assert answers(alone, kind) == theirs
        result = batched["results"][video_task_name(kind)]["exact_match,none"]
        assert result == pytest.approx(accuracy[kind], abs=1e-12)
        assert records(batched, kind) == records(alone, kind)
    kept = [r["video_tokens_kept"] for kind in QUESTION_TYPES for r in records(batched, kind)]
    if method == "none":
        assert kept == [64] * len(kept)
    else:
        inputs = processor(data.frames[[q.clip for q in data.questions]], [q.words for q in data.questions])
        assert statistics.fmean(kept) == kept_tokens(reference, inputs) == 64 * float(fraction)
    record = records(batched, "count")[0]
    assert record["video_tokens"] == 64 and record["image_tokens"] == 0
    assert record["videos"][0]["frame_indices"] == list(range(8))
    assert record["settings"]["method"] == method


def test_the_video_model_takes_one_clip_of_eight_frames_per_question() -> None:
    from PIL import Image

    from vitrim.eval.inputs import DigitsVideoPrompter

    prompter = DigitsVideoPrompter()
    frames = [Image.fromarray(np.zeros((32, 32), np.float32), mode="F")] * 8
    with pytest.raises(ValueError, match=r"reads clips of 8 frames; this video gives 4 .*max_num_frames=4"):
        prompter.read_video(frames, max_num_frames=4, fps=None)
    with pytest.raises(ValueError, match="reads videos, not pictures; question 0 has a picture"):
        prompter.inputs(["which digit appears ?"], [[frames[0]]])
    clip = prompter.read_video(frames, max_num_frames=32, fps=None)
    with pytest.raises(ValueError, match="one video per question; question 1 has 2"):
        prompter.inputs(["which digit appears ?"] * 2, [[clip], [clip, clip]])


@pytest.mark.full
def test_the_demos_table_comes_out_of_lmms_eval(tmp_path: Path) -> None:
    """Every method the video demo swept, at every kept fraction, on its first 100 held-out clips, and the dense
    model on all 200: lmms-eval's accuracies per type and the mean video tokens kept equal the shipped summary.json
    (``vitrim demo video``'s table); a seeded baseline's accuracy is the mean over the demo's seeds, as the sweep's.
    About 63 lmms-eval runs: 985 s on the loaded 2-core machine (2026-12-03)."""
    import json

    from vitrim.demos.video.demo import FULL
    from vitrim.demos.vlm.sweep import BASELINE_SEEDS, SEEDED_BASELINES
    from vitrim.eval.digits_tasks import write_digits_video_tasks
    from vitrim.shipped import shipped_run

    summary = json.loads((shipped_run("video") / "summary.json").read_text())
    manager = TaskManager(include_path=[str(write_digits_video_tasks(tmp_path / "tasks", clips=FULL.test_clips))])

    def accuracies(results: dict[str, Any]) -> dict[str, float]:
        return {kind: results["results"][video_task_name(kind)]["exact_match,none"] for kind in QUESTION_TYPES}

    dense = evaluate(lmms_model("none", DENSE, batch_size=100), manager)
    assert accuracies(dense) == pytest.approx(summary["full"], abs=1e-12)
    for method, by_fraction in summary["methods"].items():
        for fraction, row in by_fraction.items():
            seeds = (None, *BASELINE_SEEDS[1:]) if method in SEEDED_BASELINES else (None,)  # None: the default 0
            runs = [
                evaluate(lmms_model(method, fraction, 100, seed), manager, limit=FULL.sweep_clips) for seed in seeds
            ]
            found = {k: statistics.fmean(accuracies(run)[k] for run in runs) for k in QUESTION_TYPES}
            assert found == pytest.approx(row["accuracy"], abs=1e-12), (method, fraction)
            # the sweep counts the kept tokens on its timing batch: the first questions, clip-major
            by_kind = {kind: records(runs[0], kind) for kind in QUESTION_TYPES}
            first = [by_kind[QUESTION_TYPES[i % 3]][i // 3]["video_tokens_kept"] for i in range(FULL.timing_batch)]
            assert statistics.fmean(first) == pytest.approx(row["kept_tokens"], abs=1e-12), (method, fraction)


def test_a_demo_run_folder_is_read_as_its_digits_model() -> None:
    """A ``vitrim demo video`` run folder (the shipped one is such a folder) gets the digits video model's prompter,
    a ``vitrim demo vlm`` one the digits LLaVA's."""
    from vitrim.eval.inputs import DigitsPrompter, DigitsVideoPrompter, load
    from vitrim.eval.model_args import parse_model_args
    from vitrim.shipped import shipped_run

    model, prompter = load(parse_model_args({"pretrained": str(shipped_run("video"))}))
    assert isinstance(prompter, DigitsVideoPrompter) and model.config.model_type == "qwen2_vl"
    model, prompter = load(parse_model_args({"pretrained": str(shipped_run("vlm"))}))
    assert isinstance(prompter, DigitsPrompter) and model.config.model_type == "llava"
