"""VitrimGemma3ForConditionalGeneration on vLLM's CPU backend against transformers + vitrim.vlm on the same folder.

One engine for the module (started with FasterVLM keeping 6 of the 16 pooled tokens per image); each pre-LLM method
is switched in on it (``use_trim``, the engine's keep: the front end counts the placeholders), its requests naming
their images afresh (``multi_modal_uuids``: vLLM's encoder cache never hands one method's tokens to another). Per
method, three requests of different prompts and images (one with two) in one ``generate``: every request's greedy
tokens equal transformers + vitrim.vlm's, its kept tokens ``vitrim.vlm.last_selection``'s, and its prompt is shorter
by exactly the dropped soft tokens (vLLM's own count). vitrim.vlm keeps Gemma 3's kept tokens at their ORIGINAL
positions and gathers the LLM's masks (the image block both ways, the sliding window in original distance); the
tiny LLM's window (8) is shorter than the prompts, so it binds.

The same engine: a request keeping all 16 (its own ``keep``) equals unmodified transformers (the image block both
ways: vLLM's own CPU Gemma 3 attends causally there, docs/vllm.md); and each mistake put into the plugin on purpose
(a misplaced kept token, tokens in another order, a token at its neighbour's position, the image block or the
window left to vLLM's kernel) changes some request's tokens. A request asking pan-and-scan fails alone; an engine
asking it, or compiled, stops at start in one line.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import ENGINE_ARGS, gemma3_requests, overrides, transformers_reference, with_engine
from PIL import Image

from tiny_vlms.folders import save_vllm_gemma3
from vitrim.vllm.options import pre_llm_methods, trim_options

ARCHITECTURE = "VitrimGemma3ForConditionalGeneration"
TOKENS = 16  # pooled soft tokens per image, unpruned
KEEP = 6
MAX_TOKENS = 8
METHODS = pre_llm_methods(ARCHITECTURE)
MISTAKES = ("misplaced", "order", "position", "image block", "window")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma3")


@pytest.fixture(scope="module")
def folder(work: Path) -> Path:
    return save_vllm_gemma3(work / "tiny-gemma3")


@pytest.fixture(scope="module")
def requests(work: Path) -> list[dict[str, Any]]:
    return gemma3_requests(work)


@pytest.fixture(scope="module")
def reference(work: Path, folder: Path, requests: list[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    """transformers + vitrim.vlm per method (and unmodified, under None), one process for all."""
    names: list[str | None] = [None, *METHODS]
    specs = [
        {
            "folder": str(folder),
            "family": "gemma3",
            "method": name,
            "options": {} if name is None else {"keep": KEEP},
            "positions": "original",  # vitrim.vlm as it is (Gemma 3 keeps the original positions either way)
            "max_tokens": MAX_TOKENS,
            "requests": requests,
        }
        for name in names
    ]
    return dict(zip(names, transformers_reference(specs, work), strict=True))


@pytest.fixture(scope="module")
def llm(folder: Path) -> Iterator[Any]:
    """The module's engine (as tests/vllm/engines.py's ``with_engine`` starts and frees one)."""
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm import LLM

    engine = LLM(model=str(folder), hf_overrides=overrides(ARCHITECTURE, "fastervlm", keep=KEEP), **ENGINE_ARGS)
    yield engine
    del engine
    gc.collect()
    cleanup_dist_env_and_memory()


def use_method(llm: Any, method: str) -> None:
    entry = SimpleNamespace(model_type="gemma3", vitrim={"method": method, "keep": KEEP})
    options = trim_options(entry, ARCHITECTURE)
    llm.apply_model(lambda model: model.use_trim(options))


def generate(llm: Any, requests: list[dict[str, Any]], tag: str, keep: int | None = None) -> list[Any]:
    """One ``generate`` over ``requests``, their images named ``tag``-request-image (fresh for vLLM's caches);
    ``keep``: every request's own keep."""
    from vllm import SamplingParams

    prompts = []
    for index, request in enumerate(requests):
        images = [Image.open(path).convert("RGB") for path in request["images"]]
        prompt: dict[str, Any] = {
            "prompt": request["prompt"],
            "multi_modal_data": {"image": images},
            "multi_modal_uuids": {"image": [f"{tag}-{index}-{i}" for i in range(len(images))]},
        }
        if keep is not None:
            prompt["mm_processor_kwargs"] = {"vitrim": {"keep": keep}}
        prompts.append(prompt)
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)


def tokens_of(outputs: list[Any]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_the_plugin_offers_every_pre_llm_method() -> None:
    assert {"random", "fastervlm", "vispruner", "visionzip", "divprune"} <= set(METHODS)


def test_every_method_keeps_what_vitrim_vlm_keeps_and_generates_what_transformers_does(
    llm: Any, requests: list[dict[str, Any]], reference: dict[str | None, list[dict[str, Any]]]
) -> None:
    from vitrim.vllm.selection_record import recorded_selections

    for method in METHODS:
        use_method(llm, method)
        outputs = generate(llm, requests, method)
        kept = recorded_selections(llm)
        for request, output, expected in zip(requests, outputs, reference[method], strict=True):
            where = f"{method}: {request['prompt']}"
            assert list(output.outputs[0].token_ids) == expected["tokens"], where
            for seed, reference_kept in zip(expected["seeds"], expected["kept"], strict=True):
                assert kept[seed] == reference_kept, where
                assert len(reference_kept) == KEEP, where
            dropped = (TOKENS - KEEP) * len(request["images"])
            assert len(output.prompt_token_ids) == expected["prompt_tokens"] - dropped, where
    use_method(llm, "fastervlm")


def test_a_request_keeping_every_token_is_transformers_unmodified_gemma3(
    llm: Any, requests: list[dict[str, Any]], reference: dict[str | None, list[dict[str, Any]]]
) -> None:
    whole = generate(llm, requests, "whole", keep=TOKENS)
    for output, expected in zip(whole, reference[None], strict=True):
        assert list(output.outputs[0].token_ids) == expected["tokens"]
        assert len(output.prompt_token_ids) == expected["prompt_tokens"]


def test_each_mistake_in_the_plugin_changes_the_tokens(
    llm: Any, requests: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import vitrim.vllm.gemma3 as plugin
    from vitrim.vllm.gemma3_attention import OriginalMaskAttention

    mistake = SimpleNamespace(now=None)
    select_keeping_each = plugin.select_keeping_each
    embed_multimodal = plugin.VitrimGemma3ForConditionalGeneration.embed_multimodal
    differs = OriginalMaskAttention.differs

    def select(selector: Any, evidence: Any, keeps: Any) -> Any:
        chosen = select_keeping_each(selector, evidence, keeps)
        if mistake.now != "misplaced":
            return chosen
        return [type(s).unmerged(((s.kept + 1) % TOKENS).sort().values) for s in chosen]

    def embed(self: Any, **kwargs: Any) -> Any:
        out = embed_multimodal(self, **kwargs)  # per image (k, E + 1): its tokens, then their raster index
        if mistake.now == "order":  # the tokens reversed, their positions in raster order
            return tuple(torch.cat([rows[:, :-1].flip(0), rows[:, -1:]], 1) for rows in out)
        if mistake.now == "position":  # each token at its raster neighbour's position
            return tuple(torch.cat([rows[:, :-1], rows[:, -1:].roll(1, 0)], 1) for rows in out)
        return out

    def judged(self: Any, positions: Any, blocks: Any, past: int) -> bool:
        if mistake.now == "image block":  # vLLM's causal kernel alone
            return False
        if mistake.now == "window":  # the image block by the rule, the window counted in kept tokens
            return bool((blocks >= 0).any())
        return differs(self, positions, blocks, past)

    monkeypatch.setattr(plugin, "select_keeping_each", select)
    monkeypatch.setattr(plugin.VitrimGemma3ForConditionalGeneration, "embed_multimodal", embed)
    monkeypatch.setattr(OriginalMaskAttention, "differs", judged)
    found = {}
    for name in (None, *MISTAKES):
        mistake.now = name
        found[name] = tokens_of(generate(llm, requests, f"mistake {name}"))
    for name in MISTAKES:
        assert found[name] != found[None], f"the plugin with its {name} mistake gave the same tokens"


def test_a_request_asking_pan_and_scan_fails_alone(llm: Any, requests: list[dict[str, Any]]) -> None:
    from vllm import SamplingParams

    image = Image.open(requests[0]["images"][0]).convert("RGB")
    asked = {"prompt": requests[0]["prompt"], "multi_modal_data": {"image": image}}
    with pytest.raises(ValueError, match=r"^vitrim: trimmed Gemma 3 serves images without pan-and-scan[^\n]*$"):
        llm.generate([{**asked, "mm_processor_kwargs": {"do_pan_and_scan": True}}], SamplingParams(max_tokens=2))
    assert len(generate(llm, requests[:1], "after pan-and-scan")[0].outputs[0].token_ids) == MAX_TOKENS


@pytest.mark.parametrize(
    ("engine_args", "message"),
    [
        ({"mm_processor_kwargs": {"do_pan_and_scan": True}}, "vitrim: trimmed Gemma 3 serves images without pan-and"),
        ({"enforce_eager": False}, "vitrim: trimmed Gemma 3 applies its LLM's attention rule in Python"),
    ],
)
def test_what_it_cannot_serve_stops_the_engine_in_one_line(
    folder: Path, engine_args: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        with_engine(folder, overrides(ARCHITECTURE, "random", keep=KEEP), lambda llm: None, **engine_args)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)
