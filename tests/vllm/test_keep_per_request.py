"""A ``keep`` per request on vLLM's LLaVA: ``mm_processor_kwargs={"vitrim": {"keep": …}}`` (issue 51, item 3).

One engine started with VisionZip at keep 6 serves four requests together: one at the engine's keep, two with their
own (4, and a fraction 0.5 = 8 of 16), one asking to keep every token. Each equals itself alone and transformers +
vitrim.vlm applied at that request's keep (tokens, kept indices, the prompt's length), which the rest of tests/vllm
shows equals an engine started at that keep. A bad per-request value fails that request alone, in one line, and the
engine goes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.entrypoints.llm")

from engines import assert_like_reference, greedy, overrides, transformers_reference, with_engine
from PIL import Image

from tiny_vlms.folders import LLAVA_GRID
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
