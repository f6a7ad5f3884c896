"""The digits VLM's held-out questions as lmms-eval tasks read from disk: ``write_digits_tasks(folder)``.

``folder`` gets ``data/`` (a ``datasets.DatasetDict`` saved with ``save_to_disk``, one split per task) and the task
YAMLs beside it, whose ``dataset_path`` names that folder with ``dataset_kwargs: {load_from_disk: true}``; then
``lmms-eval --include_path folder --tasks vitrim_digits`` runs them with no download. The questions are the demo's
own (:func:`vitrim.demos.vlm.evaluate.held_out`: canvas ``i`` of the held-out split and its three questions), so
the accuracies lmms-eval reports are those ``vitrim demo vlm`` prints on the same canvases.

Tasks (scored by lmms-eval's own metric code):

- ``vitrim_digits_which``, ``vitrim_digits_where``, ``vitrim_digits_count``: the demo's question types, exact match
  (lmms-eval's ``exact_match``) of the generated words against the answer;
- ``vitrim_digits_pope``: POPE's yes/no probe, "is there a <digit> <quadrant> ?", half of them about the digit that is
  there (yes), half about a digit that is on no quadrant of the canvas (no: POPE's "random" negatives), scored by
  lmms-eval's POPE code (accuracy, precision, recall, F1, yes ratio). The digits VLM knows no "yes" or "no" (its 28
  words), so the model is asked what it can answer, "which digit is <quadrant> ?", and its answer counts as "yes"
  when it names the asked digit (``pope_answer``); a model that hallucinates a digit the canvas lacks says yes.

A canvas is kept exactly: ``pixels`` holds the float32 ink in [0, 1] the demo feeds (an 8-bit image would move the
ink by up to 1/510 and could change an answer), and ``doc_to_visual`` hands it on as a PIL image of mode ``"F"``,
which :mod:`vitrim.eval.inputs` reads back unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vitrim.demos.vlm.data import CANVAS, DIGIT_WORDS, QUADRANT_WORDS, QUESTION_TYPES, DigitsScenes
from vitrim.demos.vlm.evaluate import MAX_ANSWER_TOKENS, held_out

GROUP = "vitrim_digits"
POPE = "pope"
TASKS = (*QUESTION_TYPES, POPE)
DATA_FOLDER = "data"
DEFAULT_CANVASES = 200  # the demo's held-out set (VLMDemoPlan.test_canvases)


def task_name(kind: str) -> str:
    return f"{GROUP}_{kind}"


def question_rows(canvases: int, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Per task the rows of its split: the demo's held-out questions (canvas-major), and two POPE probes per canvas.

    Each row: ``question_id``, ``canvas``, ``question`` (the words the model is asked), ``answer`` (the expected
    words, or "yes"/"no" for POPE), ``pixels`` (CANVAS×CANVAS float32 ink); POPE rows add ``digit`` (the digit
    asked about) and ``category`` ("random", POPE's name for negatives drawn from absent objects).
    """
    data = held_out(canvases, seed)
    rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in TASKS}
    for number, q in enumerate(data.questions):
        rows[q.kind].append(
            {
                "question_id": f"{q.kind}-{q.canvas}-{number}",
                "canvas": q.canvas,
                "question": " ".join(q.words),
                "answer": " ".join(q.answer),
                "pixels": data.pixels[q.canvas],
            }
        )
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
    """Write the dataset (``folder/data``) and the task YAMLs (module doc) to ``folder``; returns ``folder``."""
    import datasets

    if isinstance(canvases, bool) or not isinstance(canvases, int) or canvases < 1:
        raise ValueError(f"canvases must be an int >= 1, got {canvases!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pixels = datasets.Array2D((CANVAS, CANVAS), "float32")
    common = {"question_id": "string", "canvas": "int32", "question": "string", "answer": "string"}
    splits = {}
    for kind, rows in question_rows(canvases, seed).items():
        fields = {name: datasets.Value(dtype) for name, dtype in common.items()}
        if kind == POPE:
            fields |= {"digit": datasets.Value("string"), "category": datasets.Value("string")}
        features = datasets.Features({**fields, "pixels": pixels})
        splits[kind] = datasets.Dataset.from_list(rows, features=features)
    datasets.DatasetDict(splits).save_to_disk(str(folder / DATA_FOLDER))
    for kind in TASKS:
        (folder / f"{task_name(kind)}.yaml").write_text(task_yaml(kind, folder / DATA_FOLDER))
    (folder / f"{GROUP}.yaml").write_text(
        f"group: {GROUP}\ntask:\n" + "".join(f"  - {task_name(kind)}\n" for kind in QUESTION_TYPES)
    )
    (folder / "utils.py").write_text(UTILS)
    return folder


def task_yaml(kind: str, data: Path) -> str:
    """One task's YAML: the split ``kind`` of the dataset saved at ``data``, greedy answers of up to the demo's
    ``MAX_ANSWER_TOKENS`` tokens, lmms-eval's exact match (or its POPE code)."""
    if kind == POPE:
        scoring = "process_results: !function utils.pope_process_results\nmetric_list:\n" + "".join(
            f"  - metric: {name}\n    aggregation: !function utils.pope_{aggregate}\n    higher_is_better: true\n"
            for name, aggregate in POPE_METRICS
        )
    else:
        scoring = (
            "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
            "    ignore_case: true\n    ignore_punctuation: false\n"
        )
    return (
        f"task: {task_name(kind)}\n"
        f"dataset_path: {data}\n"
        "dataset_kwargs:\n  load_from_disk: true\n"
        f"test_split: {kind}\n"
        "output_type: generate_until\n"
        "doc_to_visual: !function utils.doc_to_visual\n"
        "doc_to_text: !function utils.doc_to_text\n"
        "doc_to_target: answer\n"
        f"generation_kwargs:\n  max_new_tokens: {MAX_ANSWER_TOKENS}\n  do_sample: false\n  temperature: 0\n"
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
UTILS = '''"""Written by vitrim.eval.digits_tasks: the digits tasks' visuals, prompts and POPE scoring."""

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


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def pope_process_results(doc, results):
    return lmms_pope_process_results(doc, [pope_answer(results[0], doc["digit"])])
'''
