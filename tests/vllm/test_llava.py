"""VitrimLlavaForConditionalGeneration on vLLM's CPU backend against transformers + vitrim.vlm on the same folder.

Per pre-LLM method, one engine: three requests of different prompts and images (one with two images) run together
and each alone; every request's greedy tokens equal transformers + vitrim.vlm's, its kept image tokens equal
``vitrim.vlm.last_selection``'s, and its prompt is shorter by exactly the dropped tokens (vLLM's own count).

Positions: vLLM numbers the shortened prompt 0, 1, 2, … (docs/vllm.md), as vitrim.vlm does by default
(``positions="authors"``: the authors' sequence, VisionZip's [CLS] first); the reference runs vitrim.vlm as it is.
keep = 16 (all) is checked against vLLM's unmodified LlavaForConditionalGeneration.
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

from tiny_vlms.folders import LLAVA_GRID
from tiny_vlms.folders import save_vllm_llava as save_llava
from vitrim.vllm.options import pre_llm_methods

ARCHITECTURE = "VitrimLlavaForConditionalGeneration"
GRID = LLAVA_GRID * LLAVA_GRID  # image tokens per image, unpruned
KEEP = 6
MAX_TOKENS = 8
# cdpruner: tests/vllm/test_cdpruner.py (its selection follows the prompt, so an image these requests share keeps
# one selection per prompt, which the record by the image's pixels holds only one of)
METHODS = [name for name in pre_llm_methods() if name != "cdpruner"]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llava")


@pytest.fixture(scope="module")
def folder(work: Path) -> Path:
    return save_llava(work / "tiny-llava")


@pytest.fixture(scope="module")
def requests(work: Path) -> list[dict[str, Any]]:
    return llava_requests(work)


@pytest.fixture(scope="module")
def reference(work: Path, folder: Path, requests: list[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    """transformers + vitrim.vlm per method (and unpruned, under None), one process for all."""
    names: list[str | None] = [None, *METHODS]
    specs = [
        {
            "folder": str(folder),
            "family": "llava",
            "method": name,
            "options": {} if name is None else {"keep": KEEP},
            "positions": "original",  # vitrim.vlm as it is (its default: the authors' contiguous sequence)
            "max_tokens": MAX_TOKENS,
            "requests": requests,
        }
        for name in names
    ]
    return dict(zip(names, transformers_reference(specs, work), strict=True))


def test_the_plugin_offers_every_pre_llm_method() -> None:
    assert {"random", "fastervlm", "vispruner", "visionzip", "divprune"} <= set(METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_a_method_keeps_what_vitrim_vlm_keeps_and_generates_what_transformers_does(
    method: str, folder: Path, requests: list[dict[str, Any]], reference: dict[str | None, list[dict[str, Any]]]
) -> None:
    runs = trimmed_runs(folder, ARCHITECTURE, method, {"keep": KEEP}, requests, MAX_TOKENS)
    assert_like_reference(requests, runs, reference[method])
    patches = KEEP - (method == "visionzip")  # VisionZip's [CLS] is one of the KEEP tokens, as its authors count
    assert all(len(kept) == patches for kept in runs[2].values())


def test_keeping_every_token_is_vllms_unmodified_llava(
    folder: Path, requests: list[dict[str, Any]], reference: dict[str | None, list[dict[str, Any]]]
) -> None:
    dense = with_engine(folder, None, lambda llm: greedy(llm, requests, MAX_TOKENS))
    kept_all = with_engine(
        folder, overrides(ARCHITECTURE, "visionzip", keep=GRID), lambda llm: greedy(llm, requests, MAX_TOKENS)
    )
    for plain, trimmed, expected in zip(dense, kept_all, reference[None], strict=True):
        assert list(plain.outputs[0].token_ids) == expected["tokens"]  # vLLM's LLaVA is transformers' (the baseline)
        assert list(trimmed.outputs[0].token_ids) == expected["tokens"]
        assert trimmed.prompt_token_ids == plain.prompt_token_ids
        assert len(plain.prompt_token_ids) == expected["prompt_tokens"]


def test_original_positions_are_refused_when_the_engine_starts() -> None:
    from types import SimpleNamespace

    from vitrim.vllm.llava import llava_trim_options

    vision = SimpleNamespace(model_type="clip_vision_model", image_size=16, patch_size=4, num_hidden_layers=3)
    config = SimpleNamespace(
        model_type="llava",
        vitrim={"method": "fastervlm", "keep": 4, "positions": "original"},
        vision_config=vision,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    with pytest.raises(ValueError, match=r"vitrim: positions='original' keeps each kept token"):
        llava_trim_options(config)
    config.vitrim = {"method": "fastervlm", "keep": 4}
    assert llava_trim_options(config).method.authors_layout()
