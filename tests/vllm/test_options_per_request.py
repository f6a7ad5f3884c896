"""The engine's method's options per request: ``mm_processor_kwargs={"vitrim": {"dominant": …, "keep": …}}`` (issue 51,
item 3).

LLaVA-1.5: one engine started with VisionZip at keep 6 serves four requests together, each its own image: one at the
engine's options, three with their own ``dominant`` / ``contextual`` / ``cls`` (and keeps). Each equals itself alone
and transformers + vitrim.vlm applied with that request's options (tokens, kept indices, the prompt's length); one
image asked under two option sets (the same ``multi_modal_uuids`` name) is two cache entries, each selected by its
own options; bad values, an unknown option, another method and an option the engine fixes fail that request alone,
in one line, and the engine goes on. Qwen2.5-VL (Qwen3-VL under ``full``): one engine with VisPruner at keep 3
serves an image and a video (an image method on each temporal patch) per request, at the engine's options and at
two requests' own ``important_ratio`` (one with its own keep), in prefill chunks of 16 tokens; each equals itself
alone and the reference. Under ``full``: an engine started with a request's options equals that request; LLaVA-NeXT
(per tile) and Gemma 3, VisionZip at keep 6 with three requests' options, each equal to itself alone and the
reference.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")

from engines import (
    assert_like_reference,
    assert_media_like_reference,
    greedy,
    named_afresh,
    overrides,
    qwen_media_requests,
    random_pictures,
    reference_spec,
    transformers_reference,
    trimmed_runs,
    with_engine,
)

from tiny_vlms.folders import save_vllm_gemma3, save_vllm_llava_next, save_vllm_qwen2_5_vl, save_vllm_qwen3_vl
from tiny_vlms.folders import save_vllm_llava as save_llava
from vitrim.vllm.options import request_options, trim_options
from vitrim.vllm.request_keep import BUILT_CAPACITY, item_methods, options_bytes, select_items
from vitrim.vlm.method.base import VisionEvidence
from vitrim.vlm.stages.capture import one_image, select_keeping_each

ARCHITECTURE = "VitrimLlavaForConditionalGeneration"
ENGINE = {"keep": 6}  # VisionZip at keep 6 of LLaVA's 16 tokens: 1 contextual, 5 dominant with the [CLS]
MAX_TOKENS = 8
# each request's own entry (None: the engine's), and the options transformers + vitrim.vlm is applied with
ASKED: list[tuple[dict[str, Any] | None, dict[str, Any]]] = [
    (None, {"keep": 6}),
    ({"dominant": 2, "contextual": 4}, {"keep": 6, "dominant": 2, "contextual": 4}),
    ({"keep": 8, "contextual": 3, "cls": False}, {"keep": 8, "contextual": 3, "cls": False}),
    ({"keep": 4, "contextual": 0}, {"keep": 4, "contextual": 0}),
]
REFUSED = [  # a request's entry the engine refuses, and the start of its one line
    ({"dominant": 0}, "vitrim: this request's dominant=0 must be an int >= 1"),
    ({"frobnicate": 1}, "vitrim: this request's unknown option 'frobnicate' for vlm method 'visionzip'"),
    ({"method": "divprune"}, "vitrim: this request's method='divprune' is the engine's ('visionzip'"),
    ({"positions": "original"}, "vitrim: this request's positions='original' decides the prompt's layout"),
    ({"dominant": 3, "contextual": 1}, "vitrim: this request's keep=6 differs from dominant + contextual = 3 + 1"),
]


def one_request_spec(folder: Path, family: str, method: str, options: dict[str, Any], request: dict[str, Any]) -> Any:
    """The reference of ``request`` alone at ``options``."""
    return reference_spec(folder, family, method, options, [request], MAX_TOKENS)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("options_per_request")


@pytest.fixture(scope="module")
def llava(work: Path) -> dict[str, Any]:
    """The LLaVA engine's runs: the requests together and alone, the record, the refusals, the cache check."""
    folder = save_llava(work / "tiny-llava")
    images = random_pictures(work, [(16 + 4 * index, 20) for index in range(len(ASKED))], seed=3)
    requests = []
    for index, ((entry, _), image) in enumerate(zip(ASKED, images, strict=True)):
        request: dict[str, Any] = {"prompt": f"w{index}0 <image> w{index}1 w{index}2", "images": [image]}
        if entry is not None:
            request["mm_processor_kwargs"] = {"vitrim": entry}
        requests.append(request)

    def run(llm: Any) -> dict[str, Any]:
        from vitrim.vllm.selection_record import recorded_selections

        together = greedy(llm, requests, MAX_TOKENS)
        alone = [greedy(llm, [named_afresh(request, f"alone{i}")], MAX_TOKENS)[0] for i, request in enumerate(requests)]
        kept = recorded_selections(llm)
        # one image under one name, asked first at the engine's options, then at request 1's: two cache entries
        shared = {**requests[1], "uuids": ["shared"]}
        plain = {key: value for key, value in shared.items() if key != "mm_processor_kwargs"}
        first = greedy(llm, [plain], MAX_TOKENS)[0]
        first_kept = recorded_selections(llm)
        second = greedy(llm, [shared], MAX_TOKENS)[0]
        second_kept = recorded_selections(llm)
        refusals = []
        for entry, _ in REFUSED:
            with pytest.raises(ValueError) as refused:
                greedy(llm, [{**requests[1], "mm_processor_kwargs": {"vitrim": entry}}], MAX_TOKENS)
            refusals.append(str(refused.value))
        again = greedy(llm, [named_afresh(requests[1], "again")], MAX_TOKENS)[0]  # the engine goes on
        return {
            "requests": requests,
            "runs": (together, alone, kept),
            "shared": (first, first_kept, second, second_kept),
            "refusals": refusals,
            "again": again,
            "folder": folder,
        }

    return with_engine(folder, overrides(ARCHITECTURE, "visionzip", **ENGINE), run)


def test_llava_requests_with_their_own_options_each_equal_themselves_alone_and_the_reference(
    work: Path, llava: dict[str, Any]
) -> None:
    requests, (together, alone, kept) = llava["requests"], llava["runs"]
    specs = [
        one_request_spec(llava["folder"], "llava", "visionzip", options, request)
        for request, (_, options) in zip(requests, ASKED, strict=True)
    ]
    # the image of request 1 at the engine's options: what the shared name's first ask must select
    specs.append(one_request_spec(llava["folder"], "llava", "visionzip", ASKED[0][1], requests[1]))
    reference = [one[0] for one in transformers_reference(specs, work)]
    assert_like_reference(requests, (together, alone, kept), reference[:-1])
    # the options did something: request 1's image selects otherwise at the engine's options
    assert reference[1]["kept"] != reference[-1]["kept"]
    first, first_kept, second, second_kept = llava["shared"]
    seed = reference[1]["seeds"][0]
    assert list(first.outputs[0].token_ids) == reference[-1]["tokens"] and first_kept[seed] == reference[-1]["kept"][0]
    assert list(second.outputs[0].token_ids) == reference[1]["tokens"] and second_kept[seed] == reference[1]["kept"][0]
    assert list(llava["again"].outputs[0].token_ids) == reference[1]["tokens"]
    for refusal, (_, message) in zip(llava["refusals"], REFUSED, strict=True):
        assert refusal.startswith(message) and "\n" not in refusal, refusal


@pytest.mark.full
def test_a_llava_request_with_its_own_options_equals_an_engine_started_with_them(llava: dict[str, Any]) -> None:
    entry, options = ASKED[2]
    assert entry is not None
    request = {key: value for key, value in llava["requests"][2].items() if key != "mm_processor_kwargs"}

    def run(llm: Any) -> tuple[Any, dict[int, list[int]]]:
        from vitrim.vllm.selection_record import recorded_selections

        return greedy(llm, [request], MAX_TOKENS)[0], recorded_selections(llm)

    started, kept = with_engine(llava["folder"], overrides(ARCHITECTURE, "visionzip", **options), run)
    _, alone, asked_kept = llava["runs"]
    assert list(started.outputs[0].token_ids) == list(alone[2].outputs[0].token_ids)
    assert started.prompt_token_ids == alone[2].prompt_token_ids
    assert kept == {seed: asked_kept[seed] for seed in kept}


QWEN_FAMILIES = {  # the transformers reference's family: (the served architecture, its tiny folder, frames per patch)
    "qwen2_5_vl": ("VitrimQwen2_5_VLForConditionalGeneration", save_vllm_qwen2_5_vl, 1),
    "qwen3_vl": ("VitrimQwen3VLForConditionalGeneration", functools.partial(save_vllm_qwen3_vl, timestamps=True), 2),
}
CHUNKS = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16}
# VisPruner at keep 3: the engine's important_ratio 0.5 (1 important token of 3), then each request's own
# (none of 3; both of 2)
QWEN_ASKED: list[dict[str, Any] | None] = [None, {"important_ratio": 0.2}, {"important_ratio": 1.0, "keep": 2}]


@pytest.mark.parametrize("family", [pytest.param("qwen2_5_vl"), pytest.param("qwen3_vl", marks=pytest.mark.full)])
def test_a_qwen_request_selects_each_image_and_temporal_patch_with_its_own_options(work: Path, family: str) -> None:
    architecture, save, frames_per_patch = QWEN_FAMILIES[family]
    folder = save(work / f"tiny-{family}")
    requests = qwen_media_requests(work, f"{family}_vispruner", QWEN_ASKED, frames_per_patch, seed=4, clip_seed=40)
    engine_args = {"limit_mm_per_prompt": {"image": 1, "video": 1}, **CHUNKS}
    runs = trimmed_runs(folder, architecture, "vispruner", {"keep": 3}, requests, MAX_TOKENS, **engine_args)
    specs = [
        one_request_spec(folder, family, "vispruner", {"keep": 3, **(entry or {})}, request)
        for request, entry in zip(requests, QWEN_ASKED, strict=True)
    ]
    # each request's media at the engine's options too: the options must change what is kept
    specs += [
        one_request_spec(folder, family, "vispruner", {"keep": (entry or {}).get("keep", 3)}, request)
        for request, entry in zip(requests, QWEN_ASKED, strict=True)
    ]
    reference = [one[0] for one in transformers_reference(specs, work)]
    assert assert_media_like_reference(requests, runs, reference[:3]) > 0
    assert reference[1]["kept"] != reference[4]["kept"] and reference[2]["kept"] != reference[5]["kept"]
    assert [[len(kept) for kept in expected["kept"]] for expected in reference[:3]] == [[3, 6], [3, 6], [2, 4]]


# EVS served at video_pruning_rate 0.5, then each request's own rate: the front end counts each video's placeholders by
# it (evs_count) and the worker selects with it
VIDEO_ASKED: list[dict[str, Any] | None] = [None, {"video_pruning_rate": 0.25}, {"video_pruning_rate": 0.75}]


@pytest.mark.full
@pytest.mark.parametrize("family", list(QWEN_FAMILIES))
def test_a_qwen_request_trims_its_video_with_its_own_video_method_options(work: Path, family: str) -> None:
    architecture, save, frames_per_patch = QWEN_FAMILIES[family]
    folder = save(work / f"tiny-{family}-video")
    requests = qwen_media_requests(work, f"{family}_evs", VIDEO_ASKED, frames_per_patch, 4, seed=6, clip_seed=60)
    engine_args = {"limit_mm_per_prompt": {"image": 1, "video": 1}, **CHUNKS}
    runs = trimmed_runs(folder, architecture, "evs", {"video_pruning_rate": 0.5}, requests, MAX_TOKENS, **engine_args)
    specs = [
        one_request_spec(folder, family, "evs", {"video_pruning_rate": 0.5, **(entry or {})}, request)
        for request, entry in zip(requests, VIDEO_ASKED, strict=True)
    ]
    reference = [one[0] for one in transformers_reference(specs, work)]
    assert assert_media_like_reference(requests, runs, reference) > 0
    # the image whole; the video of 4 temporal patches of 6 at each request's rate
    assert [[len(kept) for kept in expected["kept"]] for expected in reference] == [[24, 12], [24, 18], [24, 6]]


# LLaVA-NeXT (keep per tile; tile grids the unpadding leaves whole) and Gemma 3 (keep of 16 pooled tokens):
# (the served architecture, its tiny folder, the image sizes, the image placeholder)
TILED = {
    "llava_next": ("VitrimLlavaNextForConditionalGeneration", save_vllm_llava_next, [(20, 40), (30, 30)], "<image>"),
    "gemma3": ("VitrimGemma3ForConditionalGeneration", save_vllm_gemma3, [(32, 32), (40, 24)], "<start_of_image>"),
}
TILED_ASKED: list[dict[str, Any] | None] = [None, {"dominant": 2, "contextual": 4}, {"keep": 4, "contextual": 0}]


@pytest.mark.full
@pytest.mark.parametrize("family", list(TILED))
def test_llava_next_and_gemma3_requests_select_with_their_own_options(work: Path, family: str) -> None:
    architecture, save, sizes, placeholder = TILED[family]
    folder = save(work / f"tiny-{family}")
    pictures = work / f"{family}-images"  # beside, not over, the LLaVA requests' pictures
    pictures.mkdir(exist_ok=True)
    images = random_pictures(pictures, [*sizes, sizes[0]], seed=5)
    requests = []
    for index, (entry, image) in enumerate(zip(TILED_ASKED, images, strict=True)):
        request: dict[str, Any] = {"prompt": f"w{index}0 {placeholder} w{index}1 w{index}2", "images": [image]}
        if entry is not None:
            request["mm_processor_kwargs"] = {"vitrim": entry}
        requests.append(request)

    runs = trimmed_runs(folder, architecture, "visionzip", ENGINE, requests, MAX_TOKENS)
    specs = [
        one_request_spec(folder, family, "visionzip", {**ENGINE, **(entry or {})}, request)
        for request, entry in zip(requests, TILED_ASKED, strict=True)
    ]
    assert_like_reference(requests, runs, [one[0] for one in transformers_reference(specs, work)])


def test_the_worker_builds_each_items_method_from_its_field_and_selects_each_as_alone() -> None:
    config = type("Config", (), {"model_type": "llava", "vitrim": {"method": "visionzip", "keep": 6}})()
    engine = trim_options(config, ARCHITECTURE)
    asked = request_options(engine, {"vitrim": {"dominant": 2, "contextual": 4}})
    field = [options_bytes(asked), options_bytes(engine), options_bytes(asked)]  # as the processor writes them
    built: dict[str, Any] = {}
    methods = item_methods({"vitrim_image_options": field}, "image", engine.method, built)
    assert methods[1] is engine.method and methods[0] is methods[2] and len(built) == 1
    assert methods[0].options == asked.method.options and methods[0].given == asked.method.given
    generator = torch.Generator().manual_seed(0)
    evidence = VisionEvidence(
        features=torch.randn(3, 16, 8, generator=generator),
        cls_attention=torch.rand(3, 2, 16, generator=generator),
        keys=torch.randn(3, 2, 16, 4, generator=generator),
    )

    def each(method: Any, part: VisionEvidence, keeps: list[int], items: list[int]) -> Any:
        return select_keeping_each(method, part, keeps)

    together = select_items(methods, evidence, [6, 4, 6], each)
    for image, (method, keep, chosen) in enumerate(zip(methods, [6, 4, 6], together, strict=True)):
        alone = method.select(one_image(evidence, image), keep)[0]
        assert chosen.llm_slots().tolist() == alone.llm_slots().tolist() and len(chosen.kept) == keep
        if method is not engine.method:  # its own options select otherwise than the engine's would
            assert (
                alone.llm_slots().tolist()
                != engine.method.select(one_image(evidence, image), keep)[0].llm_slots().tolist()
            )


def test_the_worker_keeps_a_bounded_number_of_option_sets_built() -> None:
    """A server's clients may ask any number of option sets: the model keeps the last BUILT_CAPACITY built, and one
    asked again after it was dropped is built again, equal to the first build."""
    config = type("Config", (), {"model_type": "llava", "vitrim": {"method": "visionzip", "keep": 6}})()
    engine = trim_options(config, ARCHITECTURE)
    built: dict[Any, Any] = {}
    asked = [request_options(engine, {"vitrim": {"dominant": 1, "contextual": c}}) for c in range(1, 71)]
    first = item_methods({"vitrim_image_options": [options_bytes(asked[0])]}, "image", engine.method, built)[0]
    for options in asked[1:]:
        item_methods({"vitrim_image_options": [options_bytes(options)]}, "image", engine.method, built)
    assert len(built) == BUILT_CAPACITY < len(asked)
    again = item_methods({"vitrim_image_options": [options_bytes(asked[0])]}, "image", engine.method, built)[0]
    assert again is not first and again.options == first.options == asked[0].method.options
