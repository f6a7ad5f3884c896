"""vitrim as an lmms-eval model: found through the entry point, scored by lmms-eval's own code, equal to the demo.

The references are independent of the code under test: the digits demo's own scorer (vitrim.demos.vlm.evaluate, which
calls ``model.generate`` itself, with its own processor and batching) on the same canvases; the same model answering
each question alone; torch's FLOP counter on the dense model's prefill, with the attention products counted by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmms_eval")

import torch
from lmms_eval.evaluator import simple_evaluate
from lmms_eval.tasks import TaskManager

from vitrim.demos.vlm.data import QUESTION_TYPES
from vitrim.eval.digits_tasks import POPE, question_rows, task_name
from vitrim.eval.lmms_model import VitrimModel

REPO = Path(__file__).resolve().parents[2]


def evaluate(
    model: VitrimModel, manager: TaskManager, kinds: tuple[str, ...], limit: int | None = None
) -> dict[str, Any]:
    tasks = [task_name(kind) for kind in kinds]
    return simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=limit, log_samples=True)


def answers_by_doc(results: dict[str, Any], task: str) -> dict[int, str]:
    return {s["doc_id"]: s["resps"][0][0] for s in results["samples"][task]}


def records(results: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return [s["token_counts"][0]["vitrim"] for s in results["samples"][task]]


def test_import_vitrim_imports_no_lmms_eval() -> None:
    code = "import sys, vitrim, vitrim.eval; print('lmms_eval' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_lmms_eval_finds_vitrim_through_its_entry_point() -> None:
    from lmms_eval.models import MODEL_REGISTRY_V2, get_model

    resolved = MODEL_REGISTRY_V2.resolve("vitrim")
    assert (resolved.model_type, resolved.class_path) == ("simple", "vitrim.eval.lmms_model.VitrimModel")
    assert get_model("vitrim") is VitrimModel


@pytest.mark.parametrize("method", ["none", "divprune"])
def test_digits_tasks_score_what_the_demo_scores(task_manager: TaskManager, canvases: int, method: str) -> None:
    """lmms-eval's exact match on the digits tasks equals the demo's accuracy per question type, canvas for canvas,
    answer for answer (the demo's scorer: vitrim.demos.vlm.evaluate.score on the same held-out canvases)."""
    import copy

    import vitrim.vlm
    from vitrim.demos.vlm.ask import load_demo_model
    from vitrim.demos.vlm.evaluate import held_out, score
    from vitrim.demos.vlm.sweep import demo_options

    options = {} if method == "none" else demo_options(method, 0.25)
    model = VitrimModel(pretrained="digits", batch_size=16, method=method, **options)
    results = evaluate(model, task_manager, QUESTION_TYPES)
    reference = load_demo_model()
    if method != "none":
        reference = vitrim.vlm.apply(copy.deepcopy(reference), method, **options)
    data = held_out(canvases)
    accuracy, demo_answers = score(reference, data)
    for kind in QUESTION_TYPES:
        task = task_name(kind)
        assert results["results"][task]["exact_match,none"] == pytest.approx(accuracy[kind], abs=1e-12)
        ours = answers_by_doc(results, task)
        theirs = [a for q, a in zip(data.questions, demo_answers, strict=True) if q.kind == kind]
        assert [ours[i] for i in range(len(theirs))] == theirs
    expected = 64 if method == "none" else 16  # keep=0.25 of 64; DivPrune hands on no [CLS]
    for record in records(results, task_name("which")):
        assert record["image_tokens"] == 64
        assert record["image_tokens_entering_llm"] == expected
        assert record["settings"]["method"] == method


def test_batched_answers_equal_each_answer_alone(task_manager: TaskManager, tiny_llava: Path) -> None:
    """A tiny random LLaVA with VisionZip: lmms-eval's batches of 5 (left padding, mixed prompt lengths: the POPE
    and "which" questions differ in length) give each sample the answer it gets alone."""
    kinds = ("which", POPE)
    args = {"pretrained": str(tiny_llava), "method": "visionzip", "keep": 6, "max_new_tokens": 4}
    batched = evaluate(VitrimModel(batch_size=5, **args), task_manager, kinds, limit=5)
    alone = evaluate(VitrimModel(batch_size=1, **args), task_manager, kinds, limit=5)
    for kind in kinds:
        task = task_name(kind)
        assert answers_by_doc(batched, task) == answers_by_doc(alone, task)
        assert records(batched, task) == records(alone, task)
        lengths = {r["text_tokens"] for r in records(batched, task)}
        assert records(batched, task)[0]["image_tokens_entering_llm"] in (6, 7)  # the kept ones (+ VisionZip's [CLS])
    assert len(lengths | {r["text_tokens"] for r in records(batched, task_name("which"))}) > 1


def test_dense_prefill_macs_match_torchs_counter(task_manager: TaskManager) -> None:
    """The dense prefill the results record equals torch's FLOP counter on the model's own prefill (matrix products
    and the patch convolution, halved to multiply-adds) plus the attention products torch's CPU attention does not
    report, counted by hand: 2·n²·d per layer (QKᵀ and A·V) in the tower (n with [CLS]) and in the LLM."""
    from torch.utils.flop_counter import FlopCounterMode

    from vitrim.demos.vlm.ask import load_demo_model
    from vitrim.eval.inputs import DigitsPrompter

    results = evaluate(VitrimModel(pretrained="digits", batch_size=4), task_manager, ("count",), limit=2)
    record = records(results, task_name("count"))[0]
    row = question_rows(1)["count"][0]
    inputs = DigitsPrompter().inputs([row["question"]], [[_canvas(row["pixels"])]])
    model = load_demo_model()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**inputs, logits_to_keep=1)
    vision, text = model.config.vision_config, model.config.text_config
    tower_tokens = (vision.image_size // vision.patch_size) ** 2 + 1
    llm_tokens = inputs["input_ids"].shape[1]
    attention = 2 * tower_tokens**2 * vision.hidden_size * vision.num_hidden_layers
    attention += 2 * llm_tokens**2 * text.num_attention_heads * text.head_dim * text.num_hidden_layers
    assert record["dense_prefill_macs"] == counter.get_total_flops() // 2 + attention
    assert record["prefill_macs"] == record["dense_prefill_macs"]


def _canvas(pixels: Any) -> Any:
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.asarray(pixels, dtype=np.float32), mode="F")


def test_the_command_line_writes_results_with_the_record(digits_tasks: Path, tmp_path: Path) -> None:
    """``lmms-eval --model vitrim`` as a user runs it: results and samples files with the averages and per sample
    records; a stacked pre-LLM + in-LLM run (DivPrune then FastV) counts what entered the LLM."""
    out = tmp_path / "out"
    model_args = "pretrained=digits,method=divprune+fastv,divprune.keep=32,fastv.keep=16,fastv.layer=2"
    command = [
        sys.executable, "-m", "lmms_eval", "--model", "vitrim", "--model_args", model_args,
        "--tasks", task_name("count"), "--include_path", str(digits_tasks), "--limit", "4",
        "--output_path", str(out), "--log_samples", "--batch_size", "4",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = list(out.rglob("*_results.json"))  # lmms-eval exits 0 after an error too: the file tells
    assert len(found) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    results_file = found[0]
    results = json.loads(results_file.read_text())
    assert results["results"][task_name("count")]["exact_match,none"] >= 0.0
    throughput = results["throughput"]
    assert throughput["avg_vitrim_image_tokens"] == 64
    assert throughput["avg_vitrim_image_tokens_entering_llm"] == 32
    assert throughput["avg_vitrim_image_tokens_kept"] == 16
    [samples_file] = out.rglob("*_samples_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 4
    record = samples[0]["token_counts"][0]["vitrim"]
    assert record["settings"]["method"] == "divprune+fastv"
    assert record["settings"]["options"]["fastv"]["layer"] == 2
    assert record["settings"]["positions"] == {"divprune": "authors"}
    assert record["prefill_macs"] is None and "one method" in record["prefill_macs_not_counted"]
    assert record["dense_prefill_macs"] > 0


def test_bad_model_args_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['visonzip'\]"):
        VitrimModel(pretrained="digits", method="visonzip")
    with pytest.raises(ValueError, match="prefix each option by its method"):
        VitrimModel(pretrained="digits", method="divprune+fastv", keep=8)
    with pytest.raises(ValueError, match="batch_size=0"):
        VitrimModel(pretrained="digits", batch_size=0)
    with pytest.raises(ValueError, match="unknown option 'dominat'"):
        VitrimModel(pretrained="digits", method="visionzip", keep=16, dominat=4)
