"""Tower methods in vLLM's SigLIP tower (VitrimGemma3ForConditionalGeneration) against transformers + vitrim.vlm.

One engine for the module (started with ToMe keeping 64 of the tower's 256 patches per image); each other tower
method is switched in on it (``use_trim``). Per method, three requests of different prompts and images (one with two
images) run together and each alone, every run naming its images afresh (``multi_modal_uuids``: vLLM's encoder
cache never hands one run's features to another, so each alone run's tower runs without the batch): every request's
greedy tokens equal transformers + ``vitrim.vlm.apply``'s on the same folder, the patches that reach the tower's last
layer equal ``vitrim.vlm.last_selection``'s, and the prompt keeps all 16 pooled soft tokens per image (the tower's
tokens go back on the patch grid, which the projector pools: vLLM's own count, as transformers'). The tiny SigLIP
has 2 layers of 256 patches and no [CLS]: HiPrune and top-k rank by the attention each patch receives.

Default: ToMe (merges: the size bias, each patch refilled with its group's token), HiPrune, and the two that take no
``keep`` (PiToMe, PPT: their options fix the count, :data:`OWN`); ``evit``, ``topk``, ``tower_random`` and
``zero_tprune`` under ``@pytest.mark.full``. FlowCut and DiffRate need a [CLS] and are
refused, in one line.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import ENGINE_ARGS, gemma3_requests, greedy, overrides, transformers_reference

from tiny_vlms.folders import save_vllm_gemma3
from vitrim.vllm.options import trim_options

ARCHITECTURE = "VitrimGemma3ForConditionalGeneration"
MAX_TOKENS = 8
DEFAULT: dict[str, dict[str, Any]] = {
    "tome": {"keep": 64},  # the fewest ToMe leaves in 2 blocks: each merges half
    "hiprune": {"keep": 100, "alpha": 0.5, "object_layer": 1},  # 10 anchors and their buffers, 50 registers
    "pitome": {"ratio": 0.8},  # no keep: 256 - ⌊256 - 204.8⌋ = 205, 205 - ⌊205 - 164⌋ = 164 (OWN)
    "ppt": {"r": 64, "threshold": 2.7e-5},  # no keep: 256 - 64 - 64 = 128 (OWN)
}
FULL: dict[str, dict[str, Any]] = {name: {"keep": 100} for name in ("evit", "topk", "tower_random", "zero_tprune")}
# the patches that reach the tower's last layer per image, by hand, where the method takes no keep (its options fix
# the count; the prompt keeps every pooled token either way). PPT's threshold sits
# between the images' variances of received-attention scores in block 0 (1.9e-5, 2.9e-5, 2.6e-5 on transformers):
# some pool, some prune; in block 1 (5.0e-5 to 6.9e-5) all prune
OWN = {"pitome": 164, "ppt": 128}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma3_tower")


@pytest.fixture(scope="module")
def folder(work: Path) -> Path:
    return save_vllm_gemma3(work / "tiny-gemma3")


@pytest.fixture(scope="module")
def requests(work: Path) -> list[dict[str, Any]]:
    return gemma3_requests(work)


@pytest.fixture(scope="module")
def reference(work: Path, folder: Path, requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """transformers + vitrim.vlm per method, one process for all (Gemma 3 keeps every position either way)."""
    methods = {**DEFAULT, **FULL}
    specs = [
        {
            "folder": str(folder),
            "family": "gemma3",
            "method": name,
            "options": options,
            "positions": "original",
            "max_tokens": MAX_TOKENS,
            "requests": requests,
        }
        for name, options in methods.items()
    ]
    return dict(zip(methods, transformers_reference(specs, work), strict=True))


@pytest.fixture(scope="module")
def llm(folder: Path) -> Iterator[Any]:
    """The module's engine (as tests/vllm/engines.py's ``with_engine`` starts and frees one)."""
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm import LLM

    engine = LLM(model=str(folder), hf_overrides=overrides(ARCHITECTURE, "tome", **DEFAULT["tome"]), **ENGINE_ARGS)
    yield engine
    del engine
    gc.collect()
    cleanup_dist_env_and_memory()


def check(llm: Any, method: str, options: dict[str, Any], requests: list[dict[str, Any]], reference: Any) -> None:
    from vitrim.vllm.selection_record import recorded_selections

    entry = SimpleNamespace(model_type="gemma3", vitrim={"method": method, **options})
    trim = trim_options(entry, ARCHITECTURE)
    llm.apply_model(lambda model: model.use_trim(trim))

    def named(request: dict[str, Any], run: str) -> dict[str, Any]:
        return {**request, "uuids": [f"{method}-{run}-{j}" for j in range(len(request["images"]))]}

    together = greedy(llm, [named(r, f"together{i}") for i, r in enumerate(requests)], MAX_TOKENS)
    alone = [greedy(llm, [named(r, f"alone{i}")], MAX_TOKENS)[0] for i, r in enumerate(requests)]
    kept = recorded_selections(llm)
    for request, batched, single, expected in zip(requests, together, alone, reference[method], strict=True):
        tokens = list(batched.outputs[0].token_ids)
        assert tokens == list(single.outputs[0].token_ids) == expected["tokens"], request["prompt"]
        assert len(batched.prompt_token_ids) == expected["prompt_tokens"]  # every pooled soft token stays
        for seed, reference_kept in zip(expected["seeds"], expected["kept"], strict=True):
            assert kept[seed] == reference_kept, request["prompt"]
            assert len(reference_kept) == OWN.get(method, options.get("keep"))


@pytest.mark.parametrize("method", list(DEFAULT))
def test_a_tower_method_in_siglip_keeps_what_vitrim_vlm_keeps_and_generates_what_transformers_does(
    method: str, llm: Any, requests: list[dict[str, Any]], reference: dict[str, list[dict[str, Any]]]
) -> None:
    check(llm, method, DEFAULT[method], requests, reference)


@pytest.mark.full
@pytest.mark.parametrize("method", list(FULL))
def test_every_fixed_schedule_reducer_in_siglip_keeps_what_vitrim_vlm_keeps(
    method: str, llm: Any, requests: list[dict[str, Any]], reference: dict[str, list[dict[str, Any]]]
) -> None:
    check(llm, method, FULL[method], requests, reference)


def test_flowcut_diffrate_and_a_tower_off_the_grid_are_refused_in_one_line(folder: Path) -> None:
    from transformers import AutoConfig

    from vitrim.vllm.gemma3 import gemma3_trim_options

    config = AutoConfig.from_pretrained(folder)
    for entry, message in (
        ({"method": "flowcut", "keep": 64}, "vitrim: flowcut scores by the [CLS] token's attention row"),
        ({"method": "diffrate", "keep": 64}, "vitrim: reducer 'diffrate' ranks tokens by [CLS] attention"),
        ({"method": "tome", "keep": 128, "to_grid": False}, "vitrim: to_grid=False is not served here: Gemma 3's"),
    ):
        config.vitrim = entry
        with pytest.raises(ValueError) as raised:
            gemma3_trim_options(config)
        assert message in str(raised.value) and "\n" not in str(raised.value)
