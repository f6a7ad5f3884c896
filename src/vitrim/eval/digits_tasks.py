"""The digits demos' held-out questions as lmms-eval tasks read from disk: ``write_digits_tasks(folder)`` (the digits
LLaVA's canvases) and ``write_digits_video_tasks(folder)`` (the digits video model's clips).

``folder`` gets the data (a ``datasets.DatasetDict`` saved with ``save_to_disk``, one split per task: ``data/`` for
the canvases, ``video_data/`` for the clips) and the task YAMLs beside it, whose ``dataset_path`` names that folder
with ``dataset_kwargs: {load_from_disk: true}``; then ``lmms-eval --include_path folder --tasks vitrim_digits`` (or
``vitrim_digits_video``) runs them with no download; both can be written to one folder. The questions are the demos'
own (:func:`vitrim.demos.vlm.evaluate.held_out`: canvas ``i`` of the held-out split and its three questions;
:func:`vitrim.demos.video.evaluate.held_out`: clip ``i`` and its three), so the accuracies lmms-eval reports are
those ``vitrim demo vlm`` / ``vitrim demo video`` print on the same canvases or clips.

Tasks (scored by lmms-eval's own metric code):

- ``vitrim_digits_which``, ``vitrim_digits_where``, ``vitrim_digits_count``: the LLaVA demo's question types, exact
  match (lmms-eval's ``exact_match``) of the generated words against the answer;
- ``vitrim_digits_pope``: POPE's yes/no probe, "is there a <digit> <quadrant> ?", half of them about the digit that is
  there (yes), half about a digit that is on no quadrant of the canvas (no: POPE's "random" negatives), scored by
  lmms-eval's POPE code (accuracy, precision, recall, F1, yes ratio). The digits VLM knows no "yes" or "no" (its 28
  words), so the model is asked what it can answer, "which digit is <quadrant> ?", and its answer counts as "yes"
  when it names the asked digit (``pope_answer``); a model that hallucinates a digit the canvas lacks says yes;
- ``vitrim_digits_video_which``, ``_when``, ``_count`` (group ``vitrim_digits_video``): the video demo's question
  types, exact match.

A canvas or clip is kept exactly: ``pixels`` holds the float32 ink in [0, 1] the LLaVA demo feeds, ``frames`` the
(8, 32, 32) float32 ink of a clip (an 8-bit image would move the ink by up to 1/510 and could change an answer).
``doc_to_visual`` hands a canvas on as a PIL image of mode ``"F"``, and ``doc_to_video`` a clip as lmms-eval's video
tasks hand a video, one entry of the visuals' list: a list of its 8 frames, each a mode-``"F"`` PIL image;
:mod:`vitrim.eval.inputs` reads both back unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vitrim.demos.video.data import FRAME, FRAMES
from vitrim.demos.video.data import QUESTION_TYPES as VIDEO_QUESTION_TYPES
from vitrim.demos.video.evaluate import MAX_ANSWER_TOKENS as VIDEO_ANSWER_TOKENS
from vitrim.demos.video.evaluate import held_out as held_out_clips
from vitrim.demos.vlm.data import CANVAS, DIGIT_WORDS, QUADRANT_WORDS, QUESTION_TYPES, DigitsScenes
from vitrim.demos.vlm.evaluate import MAX_ANSWER_TOKENS, held_out

GROUP = "vitrim_digits"
POPE = "pope"
TASKS = (*QUESTION_TYPES, POPE)
DATA_FOLDER = "data"
DEFAULT_CANVASES = 200  # the demo's held-out set (VLMDemoPlan.test_canvases)
VIDEO_GROUP = "vitrim_digits_video"
VIDEO_DATA_FOLDER = "video_data"
DEFAULT_CLIPS = 200  # the video demo's held-out set (VideoDemoPlan.test_clips)


def task_name(kind: str) -> str:
    return f"{GROUP}_{kind}"


def video_task_name(kind: str) -> str:
    return f"{VIDEO_GROUP}_{kind}"


def question_rows(canvases: int, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Per task the rows of its split: the demo's held-out questions (canvas-major), and two POPE probes per canvas.

    Each row: ``question_id``, ``canvas``, ``question`` (the words the model is asked), ``answer`` (the expected
    words, or "yes"/"no" for POPE), ``pixels`` (CANVAS×CANVAS float32 ink); POPE rows add ``digit`` (the digit
    asked about) and ``category`` ("random", POPE's name for negatives drawn from absent objects).
    """
    data = held_out(canvases, seed)
    rows = demo_rows(data.questions, TASKS, "canvas", "pixels", data.pixels)
    scenes = DigitsScenes("test", canvases, seed=seed)
    for index in range(canvases):
        rows[POPE].extend(pope_rows(index, data.digits[index], data.pixels[index], scenes.seed))
    return rows


def pope_rows(index: int, digits: tuple[int, int, int, int], pixels: np.ndarray, seed: int) -> list[dict[str, Any]]:
    """Two probes of canvas ``index``: its digit on a seeded occupied quadrant (yes), and a digit absent from the
    canvas on a seeded quadrant (no)."""
    rng = np.random.default_rng([seed, 0x907E, index])
    occupied = [q for q, d in enumerate(digits) if d >= 0]
    there = occupied[int(rng.integers(len(occupied)))]
    absent = [d for d in range(10) if d not in digits]
    missing, elsewhere = int(rng.choice(absent)), int(rng.integers(4))
    probes = [(there, digits[there], "yes"), (elsewhere, missing, "no")]
    return [
        {
            "question_id": f"pope-{index}-{answer}",
            "canvas": index,
            "question": " ".join(("which", "digit", "is", *QUADRANT_WORDS[quadrant], "?")),
            "answer": answer,
            "pixels": pixels,
            "digit": DIGIT_WORDS[digit],
            "category": "random",
        }
        for quadrant, digit, answer in probes
    ]


def pope_answer(response: str, digit: str) -> str:
    """The digits VLM's answer to "which digit is <quadrant> ?" read as POPE's yes/no about ``digit``."""
    return "yes" if response.strip().lower() == digit else "no"


def write_digits_tasks(folder: str | Path, canvases: int = DEFAULT_CANVASES, seed: int = 0) -> Path:
    """Write the canvases' dataset (``folder/data``) and their task YAMLs (module doc) to ``folder``; returns it."""
    import datasets

    _check_count("canvases", canvases)
    common = {"question_id": "string", "canvas": "int32", "question": "string", "answer": "string"}
    pixels = datasets.Array2D((CANVAS, CANVAS), "float32")
    pope = {"digit": datasets.Value("string"), "category": datasets.Value("string")}
    features = {
        kind: datasets.Features({**_values(common), **(pope if kind == POPE else {}), "pixels": pixels})
        for kind in TASKS
    }
    return _write_tasks(
        Path(folder), DATA_FOLDER, GROUP, QUESTION_TYPES, question_rows(canvases, seed), features,
        visual="doc_to_visual", max_tokens=MAX_ANSWER_TOKENS,
    )  # fmt: skip


def video_question_rows(clips: int, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Per video task the rows of its split: the video demo's held-out questions (clip-major).

    Each row: ``question_id``, ``clip``, ``question``, ``answer`` (words), ``frames`` ((8, 32, 32) float32 ink).
    """
    data = held_out_clips(clips, seed)
    return demo_rows(data.questions, VIDEO_QUESTION_TYPES, "clip", "frames", data.frames)


def demo_rows(
    questions: Sequence[Any], kinds: tuple[str, ...], item: str, visual: str, visuals: np.ndarray
) -> dict[str, list[dict[str, Any]]]:
    """Per kind the rows of a demo's ``questions``, each about ``visuals[q.<item>]`` (a canvas or a clip, kept under
    ``visual``): ``question_id``, ``item``, ``question``, ``answer``, ``visual``."""
    rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for number, q in enumerate(questions):
        index = getattr(q, item)
        rows[q.kind].append(
            {
                "question_id": f"{q.kind}-{index}-{number}",
                item: index,
                "question": " ".join(q.words),
                "answer": " ".join(q.answer),
                visual: visuals[index],
            }
        )
    return rows


def write_digits_video_tasks(folder: str | Path, clips: int = DEFAULT_CLIPS, seed: int = 0) -> Path:
    """Write the clips' dataset (``folder/video_data``) and their task YAMLs (module doc) to ``folder``; returns it."""
    import datasets

    _check_count("clips", clips)
    common = {"question_id": "string", "clip": "int32", "question": "string", "answer": "string"}
    frames = datasets.Array3D((FRAMES, FRAME, FRAME), "float32")
    features = datasets.Features({**_values(common), "frames": frames})
    return _write_tasks(
        Path(folder), VIDEO_DATA_FOLDER, VIDEO_GROUP, VIDEO_QUESTION_TYPES, video_question_rows(clips, seed),
        dict.fromkeys(VIDEO_QUESTION_TYPES, features), visual="doc_to_video", max_tokens=VIDEO_ANSWER_TOKENS,
    )  # fmt: skip


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _values(fields: dict[str, str]) -> dict[str, Any]:
    import datasets

    return {name: datasets.Value(dtype) for name, dtype in fields.items()}


def _write_tasks(
    folder: Path,
    data_folder: str,
    group: str,
    grouped: tuple[str, ...],
    rows: dict[str, list[dict[str, Any]]],
    features: dict[str, Any],
    *,
    visual: str,
    max_tokens: int,
) -> Path:
    """One split per task (``rows[kind]`` with ``features[kind]``) saved to ``folder/data_folder``, a YAML per task
    (``<group>_<kind>``), the group's YAML over the ``grouped`` kinds, and the tasks' ``utils.py``."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    splits = {kind: datasets.Dataset.from_list(kind_rows, features=features[kind]) for kind, kind_rows in rows.items()}
    datasets.DatasetDict(splits).save_to_disk(str(folder / data_folder))
    for kind in rows:
        name = f"{group}_{kind}"
        (folder / f"{name}.yaml").write_text(task_yaml(name, kind, folder / data_folder, visual, max_tokens))
    (folder / f"{group}.yaml").write_text(f"group: {group}\ntask:\n" + "".join(f"  - {group}_{k}\n" for k in grouped))
    (folder / "utils.py").write_text(UTILS)
    return folder


def task_yaml(name: str, kind: str, data: Path, visual: str, max_tokens: int) -> str:
    """Task ``name``'s YAML: the split ``kind`` of the dataset saved at ``data``, its visuals from ``utils.<visual>``,
    greedy answers of up to the demo's ``max_tokens`` tokens, lmms-eval's exact match (or its POPE code)."""
    if kind == POPE:
        scoring = "process_results: !function utils.pope_process_results\nmetric_list:\n" + "".join(
            f"  - metric: {metric}\n    aggregation: !function utils.pope_{aggregate}\n    higher_is_better: true\n"
            for metric, aggregate in POPE_METRICS
        )
    else:
        scoring = (
            "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
            "    ignore_case: true\n    ignore_punctuation: false\n"
        )
    return (
        f"task: {name}\n"
        f"dataset_path: {data}\n"
        "dataset_kwargs:\n  load_from_disk: true\n"
        f"test_split: {kind}\n"
        "output_type: generate_until\n"
        f"doc_to_visual: !function utils.{visual}\n"
        "doc_to_text: !function utils.doc_to_text\n"
        "doc_to_target: answer\n"
        f"generation_kwargs:\n  max_new_tokens: {max_tokens}\n  do_sample: false\n  temperature: 0\n"
        + scoring
        + "metadata:\n  version: 0.1\n"
    )


POPE_METRICS = (
    ("pope_accuracy", "aggregate_accuracy"),
    ("pope_precision", "aggregate_precision"),
    ("pope_recall", "aggregate_recall"),
    ("pope_f1_score", "aggregate_f1_score"),
    ("pope_yes_ratio", "aggregate_yes_ratio"),
)

# The tasks' utils.py: lmms-eval imports it from the include path (``!function utils.name``). It hands lmms-eval's
# own POPE code the model's answer read as yes/no.
UTILS = '''"""Written by vitrim.eval.digits_tasks: the digits tasks' visuals (a canvas; a clip as one
video of 8 frames), prompts and POPE scoring."""

import numpy as np
from PIL import Image

from lmms_eval.tasks.pope.utils import (
    pope_aggregate_accuracy,
    pope_aggregate_f1_score,
    pope_aggregate_precision,
    pope_aggregate_recall,
    pope_aggregate_yes_ratio,
    pope_process_results as lmms_pope_process_results,
)
from vitrim.eval.digits_tasks import pope_answer


def doc_to_visual(doc):
    return [Image.fromarray(np.asarray(doc["pixels"], dtype=np.float32), mode="F")]


def doc_to_video(doc):
    frames = np.asarray(doc["frames"], dtype=np.float32)
    return [[Image.fromarray(np.ascontiguousarray(frame), mode="F") for frame in frames]]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def pope_process_results(doc, results):
    return lmms_pope_process_results(doc, [pope_answer(results[0], doc["digit"])])
'''
