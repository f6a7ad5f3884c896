"""VitrimLlavaNextForConditionalGeneration with ``"tiles": "unpadded"`` against transformers + vitrim.vlm with
``tiles="unpadded"`` on the same folder: images whose unpadding cuts through tiles are served.

One engine per method (6 tokens per tile) runs six requests in one ``generate`` call, then each alone (its images
named afresh, so the tower runs again): a 4:3 and a 16:9 photo (every grid tile cut), a 3:4 and a 4:1 image in one
prompt, a pinpoint-ratio image at its request's own ``keep`` 3, a 16:9 one at its own ``keep`` 0.4 (a fraction of
each tile's surviving tokens) and one at its own ``keep`` 10 (more than a cut tile's 8: all of them). Each request's
greedy tokens equal transformers + vitrim.vlm's, its kept packed positions equal ``vitrim.vlm.last_selection``'s, its
prompt is shorter than the unpruned one by exactly the dropped tokens, and each image's placeholders are
``Σ min(keep, n_tile) + newlines``, counted here by hand. FasterVLM, VisionZip and DivPrune run by default; every
other method the plugin serves on LLaVA-NeXT under ``-m full``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import assert_like_reference, random_pictures, transformers_reference, trimmed_runs

from tiny_vlms.folders import save_vllm_llava_next
from vitrim.vllm.options import pre_llm_methods

ARCHITECTURE = "VitrimLlavaNextForConditionalGeneration"
IMAGE_TOKEN = 3  # the tiny folders' <image>
KEEP = 6
MAX_TOKENS = 8
TILES = {"tiles": "unpadded"}
DEFAULT_METHODS = ("fastervlm", "visionzip", "divprune")
# (height, width) on the pinpoints 16×32, 32×16, 32×32 (16-px tiles of 4 × 4 tokens): 4:3 (2×2 grid, 8 token rows
# unpadded to 6: each grid tile keeps 12 of 16), 16:9 (rows to 4: 8 of 16), 3:4 (columns to 6: 12 of 16), 4:1 (1×2
# grid, rows to 2: 8 of 16), 1:2 (a pinpoint's: nothing cut), 16:9 twice more (other pixels)
SIZES = [(30, 40), (27, 48), (40, 30), (20, 80), (20, 40), (18, 32), (45, 80)]
# each image's placeholders by hand: the base tile's min(keep, 16), each grid tile's min(keep, n), a newline per row
BY_HAND = [
    [6 + 4 * 6 + 6],  # 4:3: 4 tiles of 12, 6 rows
    [6 + 4 * 6 + 4],  # 16:9: 4 tiles of 8, 4 rows
    [6 + 4 * 6 + 8, 6 + 2 * 6 + 2],  # 3:4: 4 tiles of 12, 8 rows; 4:1: 2 tiles of 8, 2 rows
    [3 + 2 * 3 + 4],  # keep 3: 1:2 grid, 4 rows
    [6 + 4 * 3 + 4],  # keep 0.4: round(6.4) of the base tile, round(3.2) of each tile of 8, 4 rows
    [10 + 4 * 8 + 4],  # keep 10: 10 of the base tile, all 8 of each cut tile (min(10, 8)), 4 rows
]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llava_next_unpadded")


@pytest.fixture(scope="module")
def folder(work: Path) -> Path:
    return save_vllm_llava_next(work / "tiny-llava-next")


@pytest.fixture(scope="module")
def requests(work: Path) -> list[dict[str, Any]]:
    paths = random_pictures(work, SIZES, seed=3)
    return [
        {"prompt": "w10 w11 <image> w12 w13", "images": [paths[0]]},
        {"prompt": "w20 <image> w21 w22 w23 w24", "images": [paths[1]]},
        {"prompt": "w30 w31 <image> w32 <image> w33", "images": [paths[2], paths[3]]},
        {"prompt": "w40 <image> w41 w42", "images": [paths[4]], "mm_processor_kwargs": {"vitrim": {"keep": 3}}},
        {"prompt": "w50 w51 <image> w52", "images": [paths[5]], "mm_processor_kwargs": {"vitrim": {"keep": 0.4}}},
        {"prompt": "w60 <image> w61 w62", "images": [paths[6]], "mm_processor_kwargs": {"vitrim": {"keep": 10}}},
    ]


def reference_runs(work: Path, folder: Path, method: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers + vitrim.vlm with ``tiles="unpadded"`` on each request at its keep (one process), in order."""
    keeps = [request.get("mm_processor_kwargs", {}).get("vitrim", {}).get("keep", KEEP) for request in requests]
    specs = [
        {
            "folder": str(folder),
            "family": "llava_next",
            "method": method,
            "options": {"keep": keep, **TILES},
            "positions": "original",  # vitrim.vlm as it is (its default: the authors' contiguous sequence)
            "max_tokens": MAX_TOKENS,
            "requests": [request for request, asked in zip(requests, keeps, strict=True) if asked == keep],
        }
        for keep in sorted(set(keeps))
    ]
    outs = transformers_reference(specs, work)
    by_keep = {spec["options"]["keep"]: iter(out) for spec, out in zip(specs, outs, strict=True)}
    return [next(by_keep[keep]) for keep in keeps]


def check_method(method: str, work: Path, folder: Path, requests: list[dict[str, Any]]) -> None:
    runs = trimmed_runs(folder, ARCHITECTURE, method, {"keep": KEEP, **TILES}, requests, MAX_TOKENS)
    reference = reference_runs(work, folder, method, requests)
    assert_like_reference(requests, runs, reference)
    for out, expected, counts in zip(runs[0], reference, BY_HAND, strict=True):
        assert expected["entered"] == counts
        assert out.prompt_token_ids.count(IMAGE_TOKEN) == sum(counts)


@pytest.mark.parametrize("method", DEFAULT_METHODS)
def test_cut_tiles_are_served_keeping_what_vitrim_vlm_keeps_with_the_option(
    method: str, work: Path, folder: Path, requests: list[dict[str, Any]]
) -> None:
    check_method(method, work, folder, requests)


@pytest.mark.full
@pytest.mark.parametrize("method", [name for name in pre_llm_methods(ARCHITECTURE) if name not in DEFAULT_METHODS])
def test_every_other_method_serves_cut_tiles_as_vitrim_vlm_selects_them(
    method: str, work: Path, folder: Path, requests: list[dict[str, Any]]
) -> None:
    check_method(method, work, folder, requests)
