"""A ``keep`` per request: ``mm_processor_kwargs={"vitrim": {"keep": …}}`` (issue 51, item 3).

LLaVA: one engine started with VisionZip at keep 6 serves four requests together: one at the engine's keep, two with
their own (4, and a fraction 0.5 = 8 of 16), one asking to keep every token. Qwen2.5-VL and Qwen3-VL (its videos'
timestamps, its DeepStack rows): one engine each with DivPrune at keep 3 serves an image and a video (its keep is per
temporal patch) at the engine's keep, at 2, and at 0.5, in prefill chunks of 16 tokens (each image and video
split across chunks). Each
request equals itself alone and transformers + vitrim.vlm applied at that request's keep (tokens, kept indices, the
prompt's length), which the rest of tests/vllm shows equals an engine started at that keep. A bad per-request value
fails that request alone, in one line, and the engine goes on.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.entrypoints.llm")

from engines import (
    assert_like_reference,
    greedy,
    media_of,
    overrides,
    qwen_media_requests,
    transformers_reference,
    with_engine,
)
from PIL import Image

from tiny_vlms.folders import LLAVA_GRID, save_vllm_qwen2_5_vl, save_vllm_qwen3_vl
from tiny_vlms.folders import save_vllm_llava as save_llava

ARCHITECTURE = "VitrimLlavaForConditionalGeneration"
ENGINE_KEEP = 6
MAX_TOKENS = 8
# each request's own keep (None: the engine's), and the count it means of the 16 image tokens
ASKED: list[tuple[int | float | None, int]] = [(None, 6), (4, 4), (0.5, 8), (LLAVA_GRID * LLAVA_GRID, 16)]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keep_per_request")


@pytest.fixture(scope="module")
def requests(work: Path) -> list[dict[str, Any]]:
    """One request per entry of ASKED, each with its own image (the plugin records selections by the pixels' seed)."""
    rng = np.random.default_rng(1)
    made = []
    for index, (asked, _) in enumerate(ASKED):
        path = work / f"image{index}.png"
        Image.fromarray(rng.integers(0, 256, (16 + 4 * index, 20, 3), dtype=np.uint8)).save(path)
        request: dict[str, Any] = {"prompt": f"w{index}0 <image> w{index}1 w{index}2", "images": [str(path)]}
        if asked is not None:
            request["mm_processor_kwargs"] = {"vitrim": {"keep": asked}}
        made.append(request)
    return made


def test_each_request_keeps_its_own_count_together_and_alone(work: Path, requests: list[dict[str, Any]]) -> None:
    folder = save_llava(work / "tiny-llava")

    def run(llm: Any) -> tuple[list[Any], list[Any], dict[int, list[int]], str]:
        from vitrim.vllm.selection_record import recorded_selections

        together = greedy(llm, requests, MAX_TOKENS)
        alone = [greedy(llm, [request], MAX_TOKENS)[0] for request in requests]
        kept = recorded_selections(llm)
        bad = {**requests[1], "mm_processor_kwargs": {"vitrim": {"keep": 0}}}
        with pytest.raises(ValueError) as refused:
            greedy(llm, [bad], MAX_TOKENS)
        again = greedy(llm, [requests[1]], MAX_TOKENS)[0]  # the engine goes on
        assert list(again.outputs[0].token_ids) == list(alone[1].outputs[0].token_ids)
        return together, alone, kept, str(refused.value)

    together, alone, kept, refusal = with_engine(folder, overrides(ARCHITECTURE, "visionzip", keep=ENGINE_KEEP), run)
    assert "vitrim: this request's keep=0" in refusal, refusal
    specs = [
        {
            "folder": str(folder),
            "family": "llava",
            "method": "visionzip",
            "options": {"keep": count},
            "positions": "original",
            "max_tokens": MAX_TOKENS,
            "requests": [request],
        }
        for request, (_, count) in zip(requests, ASKED, strict=True)
    ]
    reference = [one[0] for one in transformers_reference(specs, work)]
    assert_like_reference(requests, (together, alone, kept), reference)
    # the prompts differ only by their placeholders: each holds exactly its own count
    assert len({len(out.prompt_token_ids) - count for out, (_, count) in zip(together, ASKED, strict=True)}) == 1


QWEN_FAMILIES = {  # the transformers reference's family: (the served architecture, its tiny folder, frames per patch)
    "qwen2_5_vl": ("VitrimQwen2_5_VLForConditionalGeneration", save_vllm_qwen2_5_vl, 1),
    "qwen3_vl": ("VitrimQwen3VLForConditionalGeneration", functools.partial(save_vllm_qwen3_vl, timestamps=True), 2),
}
# prefill chunks of 16 tokens: every image and video is split across chunks, each chunk re-numbered on its own
CHUNKS = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16}
QWEN_ASKED: list[int | float | None] = [None, 2, 0.5]  # the engine's 3, then each request's own


@pytest.mark.parametrize("family", list(QWEN_FAMILIES))
def test_a_qwen_request_keeps_its_own_count_of_each_image_and_temporal_patch(work: Path, family: str) -> None:
    architecture, save, frames_per_patch = QWEN_FAMILIES[family]
    folder = save(work / f"tiny-{family}")
    entries = [None if asked is None else {"keep": asked} for asked in QWEN_ASKED]
    requests = qwen_media_requests(work, family, entries, frames_per_patch)

    def run(llm: Any) -> tuple[list[Any], list[Any], dict[int, list[int]]]:
        from vitrim.vllm.selection_record import recorded_selections

        together = greedy(llm, requests, MAX_TOKENS)
        alone = [greedy(llm, [request], MAX_TOKENS)[0] for request in requests]
        return together, alone, recorded_selections(llm)

    together, alone, recorded = with_engine(
        folder, overrides(architecture, "divprune", keep=3), run, limit_mm_per_prompt={"image": 1, "video": 1}, **CHUNKS
    )
    specs = [
        {
            "folder": str(folder),
            "family": family,
            "method": "divprune",
            "options": {"keep": 3 if asked is None else asked},
            "positions": "original",
            "max_tokens": MAX_TOKENS,
            "requests": [request],
        }
        for request, asked in zip(requests, QWEN_ASKED, strict=True)
    ]
    reference = [one[0] for one in transformers_reference(specs, work)]
    kept_counts = []
    for request, batched, single, expected in zip(requests, together, alone, reference, strict=True):
        tokens = list(batched.outputs[0].token_ids)
        assert tokens == list(single.outputs[0].token_ids) == expected["tokens"], request["prompt"]
        dropped = 0
        for (seed, full), kept in zip(media_of(expected), expected["kept"], strict=True):
            assert recorded[seed] == kept, request["prompt"]
            dropped += full - len(kept)
        assert len(batched.prompt_token_ids) == expected["prompt_tokens"] - dropped, request["prompt"]
        kept_counts.append([len(kept) for kept in expected["kept"]])
    # image of 24 tokens, video of 2 temporal patches of 6: the engine's 3, the request's 2, half
    assert kept_counts == [[3, 6], [2, 4], [12, 6]]
