"""VitrimQwen2_5_VLForConditionalGeneration and VitrimQwen3VLForConditionalGeneration on vLLM's CPU backend against
transformers + vitrim.vlm (same folder). The tiny Qwen3-VL is laid out as the released checkpoints (DeepStack taps,
interleaved M-RoPE, temporal patches of 2 frames): its DeepStack rows are cut with the kept indices.

Per pre-LLM method, one engine: three requests with images of three sizes (one taller than wide, one prompt with
two images) run together and each alone; every request's greedy tokens equal transformers + vitrim.vlm's, its kept
image tokens equal ``vitrim.vlm.last_selection``'s, its prompt is shorter by exactly the dropped tokens.

Positions: both keep each kept token's original M-RoPE position and continue the text after an image where the full
image would end (vitrim.vllm.compat.image_positions); the reference is vitrim.vlm as it is. keep = 1.0 (every token)
is checked against vLLM's unmodified class (Qwen2_5_VL…, Qwen3VLForConditionalGeneration), and that against
transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import (
    assert_like_reference,
    greedy,
    overrides,
    random_pictures,
    transformers_reference,
    trimmed_runs,
    with_engine,
)
from PIL import Image

from tiny_vlms.folders import save_vllm_qwen2_5_vl, save_vllm_qwen3_vl
from vitrim.vllm.options import pre_llm_methods

FAMILIES = {  # the transformers reference's family: (the served architecture, its tiny folder)
    "qwen2_5_vl": ("VitrimQwen2_5_VLForConditionalGeneration", save_vllm_qwen2_5_vl),
    "qwen3_vl": ("VitrimQwen3VLForConditionalGeneration", save_vllm_qwen3_vl),
}
KEEP = 6
MAX_TOKENS = 8
# cdpruner: tests/vllm/test_cdpruner.py (its selection follows the prompt, so an image these requests share keeps
# one selection per prompt, which the record by the image's pixels holds only one of)
METHODS = [name for name in pre_llm_methods() if name != "cdpruner"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def architecture(family: str) -> str:
    return FAMILIES[family][0]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    return tmp_path_factory.mktemp(family)


@pytest.fixture(scope="module")
def folder(work: Path, family: str) -> Path:
    return FAMILIES[family][1](work / "tiny")


@pytest.fixture(scope="module")
def requests(work: Path) -> list[dict[str, Any]]:
    """Images of 4×6, 6×4 (taller than wide) and 5×5 tokens (4 px each); the last prompt holds two."""
    paths = random_pictures(work, [(16, 24), (24, 16), (20, 20)], seed=1)
    return [
        {"prompt": f"w10 w11 {IMAGE} w12 w13", "images": [paths[0]]},
        {"prompt": f"w20 {IMAGE} w21 w22 w23 w24 w25 w26", "images": [paths[1]]},
        {"prompt": f"w30 w31 {IMAGE} w32 {IMAGE} w33", "images": [paths[2], paths[1]]},
    ]


@pytest.fixture(scope="module")
def reference(
    work: Path, family: str, folder: Path, requests: list[dict[str, Any]]
) -> dict[str | None, list[dict[str, Any]]]:
    names: list[str | None] = [None, *METHODS]
    specs = [
        {
            "folder": str(folder),
            "family": family,
            "method": name,
            "options": {} if name is None else {"keep": KEEP},
            "positions": "original",
            "max_tokens": MAX_TOKENS,
            "requests": requests,
        }
        for name in names
    ]
    return dict(zip(names, transformers_reference(specs, work), strict=True))


@pytest.mark.parametrize("method", METHODS)
def test_a_method_keeps_what_vitrim_vlm_keeps_and_generates_what_transformers_does(
    method: str,
    architecture: str,
    folder: Path,
    requests: list[dict[str, Any]],
    reference: dict[str | None, list[dict[str, Any]]],
) -> None:
    runs = trimmed_runs(folder, architecture, method, {"keep": KEEP}, requests, MAX_TOKENS)
    assert_like_reference(requests, runs, reference[method])
    assert all(len(kept) == KEEP for kept in runs[2].values())


def test_keeping_every_token_is_vllms_unmodified_qwen(
    architecture: str, folder: Path, requests: list[dict[str, Any]], reference: dict[str | None, list[dict[str, Any]]]
) -> None:
    dense = with_engine(folder, None, lambda llm: greedy(llm, requests, MAX_TOKENS))
    kept_all = with_engine(
        folder, overrides(architecture, "visionzip", keep=1.0), lambda llm: greedy(llm, requests, MAX_TOKENS)
    )
    for plain, trimmed, expected in zip(dense, kept_all, reference[None], strict=True):
        assert list(plain.outputs[0].token_ids) == expected["tokens"]  # vLLM's Qwen is transformers' (the baseline)
        assert list(trimmed.outputs[0].token_ids) == expected["tokens"]
        assert trimmed.prompt_token_ids == plain.prompt_token_ids
        assert len(plain.prompt_token_ids) == expected["prompt_tokens"]


def test_an_int_keep_above_a_requests_image_fails_that_request_only(
    architecture: str, folder: Path, requests: list[dict[str, Any]], work: Path
) -> None:
    small = work / "small.png"
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(small)  # 4×4 = 16 tokens
    too_small = {"prompt": f"w10 {IMAGE} w11", "images": [str(small)]}

    def run(llm: Any) -> tuple[str, list[int], list[int]]:
        before = list(greedy(llm, requests[:1], MAX_TOKENS)[0].outputs[0].token_ids)  # 24 tokens: keeps 20
        with pytest.raises(ValueError) as raised:
            greedy(llm, [too_small], MAX_TOKENS)
        after = list(greedy(llm, requests[:1], MAX_TOKENS)[0].outputs[0].token_ids)
        return str(raised.value), before, after

    message, before, after = with_engine(folder, overrides(architecture, "fastervlm", keep=20), run)
    assert "vitrim: keep=20 is more than the image's 16 tokens; expected 1 … 16" in message
    assert before == after
