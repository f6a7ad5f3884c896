"""Tower methods in vLLM's CLIP tower (VitrimLlavaForConditionalGeneration) against transformers + vitrim.vlm.

Per method, one engine: three requests of different prompts and images (one with two images) run together and each
alone (its images named afresh, so its tower runs again); every request's greedy tokens equal transformers +
``vitrim.vlm.apply``'s on the same folder, the patches that reach the feature layer equal
``vitrim.vlm.last_selection``'s, and the prompt is shorter by exactly the patches the tower removed (vLLM's own
count, written before the tower runs). The tiny tower has 3 layers and feature layer −2: the reductions run in
blocks 0 and 1, on 16 patches.

Default: ToMe (merges, so the second block's attention needs the log-size bias), FlowCut (images of one batch keep
different counts between its cuts: the stage pads them with size-0 tokens), HiPrune (its object layer's attention
kept for the feature block's cut), PPT and PiToMe (no ``keep``: the prompt holds the count their ``r`` and
``ratio`` fix, :data:`OWN`; PPT's images prune in some blocks and pool in others; each engine costs about 3 s here).
FlowCut runs on a 7-layer tower, where its first two cuts leave each image its own count (on 3 layers it cuts once,
straight to keep). The other fixed-schedule reducers: ``@pytest.mark.full``.

Positions: vLLM numbers the shortened prompt 0, 1, 2, … (docs/vllm.md); vitrim.vlm's tower stage keeps each token at
its patch's position on transformers, so the reference numbers the LLM input contiguously (``positions="contiguous"``
in tests/vllm/transformers_reference.py); the kept tokens, their order and the prompt's length are vitrim.vlm's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import (
    assert_like_reference,
    greedy,
    llava_requests,
    overrides,
    transformers_reference,
    trimmed_runs,
    with_engine,
)

from tiny_vlms.folders import save_vllm_llava as save_llava
from vitrim.vlm_user.tiny import VLLM_LLAVA_VISION

ARCHITECTURE = "VitrimLlavaForConditionalGeneration"
MAX_TOKENS = 8
KEEP = 6
DEFAULT: dict[str, dict[str, Any]] = {
    "tome": {"keep": KEEP},
    "flowcut": {"keep": KEEP},  # on the 7-layer tower (DEEP)
    "hiprune": {"keep": 10, "alpha": 0.5, "object_layer": 1},  # 1 anchor, its 4 buffers, 5 registers
    "ppt": {"r": 4, "threshold": 0.0058},  # no keep: its own count, 16 - 4 - 4 = 8 (OWN)
    "pitome": {"ratio": 0.8},  # no keep: its own count, 16 - ⌊16 - 12.8⌋ = 13, 13 - ⌊13 - 10.4⌋ = 11 (OWN)
}
FULL: dict[str, dict[str, Any]] = {
    name: {"keep": KEEP} for name in ("evit", "topk", "tower_random", "zero_tprune", "diffrate")
}
# the patches that reach the feature layer per image, by hand, where the method takes no keep (the prompt is written
# with vitrim.vllm.options.OWN_COUNTS' count before the tower runs); PPT's threshold sits between the tiny tower's
# images' score variances (block 0: 0.0065, 0.0052, 0.0061; block 1: 0.0015, 0.0037, 0.0091; read on transformers),
# so in each block some images prune and some pool (both leave the same count)
OWN = {"ppt": 8, "pitome": 11}
# FlowCut cuts straight to keep in the block before the feature block's: on 3 layers (feature block 1) it cuts once;
# on 7 (feature block 5) blocks 0 and 2 cut first by each image's [CLS] entropy, so a batch's images differ in
# count over four blocks (on 5 layers, over two, the padding's mask went untested: the tokens did not change)
DEEP = {"flowcut"}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llava_tower")


@pytest.fixture(scope="module")
def folders(work: Path) -> dict[bool, Path]:
    """The tiny LLaVA (3 tower layers) under False, one with 7 tower layers under True (:data:`DEEP`)."""
    deep = {**VLLM_LLAVA_VISION, "num_hidden_layers": 7}
    return {False: save_llava(work / "tiny-llava"), True: save_llava(work / "deep-llava", vision=deep)}


@pytest.fixture(scope="module")
def requests(work: Path) -> list[dict[str, Any]]:
    return llava_requests(work, seed=1)


@pytest.fixture(scope="module")
def reference(work: Path, folders: dict[bool, Path], requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """transformers + vitrim.vlm per method, the LLM input numbered 0, 1, 2, … as vLLM numbers it; one process."""
    methods = {**DEFAULT, **FULL}
    specs = [
        {
            "folder": str(folders[name in DEEP]),
            "family": "llava",
            "method": name,
            "options": options,
            "positions": "contiguous",
            "max_tokens": MAX_TOKENS,
            "requests": requests,
        }
        for name, options in methods.items()
    ]
    return dict(zip(methods, transformers_reference(specs, work), strict=True))


def check(method: str, options: dict[str, Any], folders: Any, requests: list[dict[str, Any]], reference: Any) -> None:
    """One engine: the requests together, then each alone under fresh image names (``trimmed_runs``: its tower runs
    on its images only, no batch, no padding)."""
    runs = trimmed_runs(folders[method in DEEP], ARCHITECTURE, method, options, requests, MAX_TOKENS)
    assert_like_reference(requests, runs, reference[method])
    assert all(len(kept) == OWN.get(method, options.get("keep")) for kept in runs[2].values())


@pytest.mark.parametrize("method", list(DEFAULT))
def test_a_tower_method_keeps_what_vitrim_vlm_keeps_and_generates_what_transformers_does(
    method: str, folders: dict[bool, Path], requests: list[dict[str, Any]], reference: dict[str, list[dict[str, Any]]]
) -> None:
    check(method, DEFAULT[method], folders, requests, reference)


@pytest.mark.full
@pytest.mark.parametrize("method", list(FULL))
def test_every_fixed_schedule_reducer_keeps_what_vitrim_vlm_keeps(
    method: str, folders: dict[bool, Path], requests: list[dict[str, Any]], reference: dict[str, list[dict[str, Any]]]
) -> None:
    check(method, FULL[method], folders, requests, reference)


def test_a_requests_own_keep_is_refused_alone_and_the_engine_goes_on(
    folders: dict[bool, Path], requests: list[dict[str, Any]], reference: dict[str, list[dict[str, Any]]]
) -> None:
    def run(llm: Any) -> tuple[str, list[int]]:
        asked = {**requests[0], "mm_processor_kwargs": {"vitrim": {"keep": 4}}}
        with pytest.raises(ValueError) as refused:
            greedy(llm, [asked], MAX_TOKENS)
        return str(refused.value), list(greedy(llm, [requests[0]], MAX_TOKENS)[0].outputs[0].token_ids)

    refusal, tokens = with_engine(folders[False], overrides(ARCHITECTURE, "tome", keep=KEEP), run)
    assert "vitrim: method 'tome' reduces inside the tower" in refusal and "\n" not in refusal
    assert tokens == reference["tome"][0]["tokens"]
