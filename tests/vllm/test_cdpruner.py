"""CDPruner served (issue 51, item 2): each image's selection reads the prompt it answers to, handed from vLLM's front
end to the worker as processor fields (vitrim.vllm.prompt_instruction), as vitrim.vlm reads it on transformers.

One engine per case, many requests: LLaVA-1.5, Qwen2.5-VL and Qwen3-VL under ``relevance="llm"`` (the default: the
LLM's embeddings of the prompt's text after the image), LLaVA-1.5 under ``relevance="clip"`` (the authors' signal:
each request's question through a tiny CLIP's text tower, saved in the test, loaded offline). The requests differ in
their text; one image is asked under two prompts (its selection must follow each prompt: vLLM's processor and encoder
caches key an image by its text too), two images share a prompt (each reads the text after itself), one request asks
its own keep (under ``"clip"``: one its own ``theta``). Each request, together and alone, equals transformers +
vitrim.vlm on the same folder (greedy tokens, the kept indices of each image, the prompt's length); the reference's
selections for the shared image differ between its two prompts (the check can see a wrong text). A prompt that ends
on an image is not among them: transformers then keeps its last token for generate() to read, vLLM does not, whatever
the method. A request the engine cannot serve (a video, a question the engine does not read, no question under
``"clip"``) fails alone, in one line, and the engine goes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.entrypoints.llm")

from engines import clip_frames, greedy, overrides, transformers_reference, with_engine
from PIL import Image

from tiny_vlms.clip_text import save_tiny_clip, tiny_clip
from tiny_vlms.folders import save_vllm_llava, save_vllm_qwen2_5_vl, save_vllm_qwen3_vl
from vitrim.vlm_user.tiny import VLLM_LLAVA_VISION

MAX_TOKENS = 6
LLAVA = "VitrimLlavaForConditionalGeneration"
QWEN = {"qwen2_5_vl": "VitrimQwen2_5_VLForConditionalGeneration", "qwen3_vl": "VitrimQwen3VLForConditionalGeneration"}
IMAGE = {"llava": "<image>", "qwen": "<|vision_start|><|image_pad|><|vision_end|>"}
# (prompt with {image} slots, the images it shows by name, its own keep or None): "a" under two prompts, "b" and "c"
# in one prompt (the text after "b" holds "c"'s tokens, which are not text), "d" after most of its prompt
PROMPTS: list[tuple[str, list[str], int | float | None]] = [
    ("w10 {image} w11 w12 w13", ["a"], None),
    ("w20 w21 {image} w22 w23 w24 w25", ["a"], None),
    ("w30 {image} w31 {image} w32 w33", ["b", "c"], None),
    ("w40 w41 w42 w43 {image} w44", ["d"], None),
    ("w50 {image} w51 w52", ["e"], 0.5),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cdpruner")


def make_requests(work: Path, family: str, size: tuple[int, int], seed: int) -> list[dict[str, Any]]:
    """The :data:`PROMPTS` with ``family``'s image text, each named image a random PNG of ``size`` (H, W)."""
    rng = np.random.default_rng(seed)
    paths = {}
    for name in "abcde":
        paths[name] = work / f"{family}_{name}.png"
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(paths[name])
    requests = []
    for text, names, keep in PROMPTS:
        request: dict[str, Any] = {
            "prompt": text.format(image=IMAGE["llava" if family.startswith("llava") else "qwen"]),
            "images": [str(paths[name]) for name in names],
        }
        if keep is not None:
            request["mm_processor_kwargs"] = {"vitrim": {"keep": keep}}
        requests.append(request)
    return requests


def served(llm: Any, requests: list[dict[str, Any]]) -> tuple[list[Any], list[tuple[Any, dict[int, list[int]]]]]:
    """The requests together, then each alone with what its images kept (read after it: an image asked under two
    prompts is recorded under its pixels' seed by the last request that encoded it; fresh names for its images keep
    vLLM's encoder cache from handing on the together run's features, so it is encoded again)."""
    from vitrim.vllm.selection_record import recorded_selections

    together = greedy(llm, requests, MAX_TOKENS)
    alone = []
    for index, request in enumerate(requests):
        uuids = [f"alone-{index}-{image}" for image in range(len(request["images"]))]
        out = greedy(llm, [{**request, "uuids": uuids}], MAX_TOKENS)[0]
        alone.append((out, recorded_selections(llm)))
    return together, alone


def refused(llm: Any, request: dict[str, Any], message: str, again: dict[str, Any]) -> None:
    """``request`` fails alone with ``message`` in one line; ``again`` is served after it."""
    with pytest.raises(ValueError) as raised:
        greedy(llm, [request], MAX_TOKENS)
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
    assert greedy(llm, [again], MAX_TOKENS)[0].outputs[0].token_ids


def assert_equals_reference(
    requests: list[dict[str, Any]],
    runs: tuple[list[Any], list[tuple[Any, dict[int, list[int]]]]],
    reference: list[dict[str, Any]],
    shared: tuple[int, int] = (0, 1),
) -> None:
    """Each request alone: the reference's tokens, each image's kept indices, the prompt's length less the dropped
    image tokens; together: the tokens alone. The image the ``shared`` requests both show keeps other tokens in each
    (the reference's), so a selection reading the wrong text is seen."""
    together, alone = runs
    for request, batched, (single, kept), expected in zip(requests, together, alone, reference, strict=True):
        tokens = list(single.outputs[0].token_ids)
        assert tokens == expected["tokens"], request["prompt"]
        assert list(batched.outputs[0].token_ids) == tokens, request["prompt"]
        dropped = 0
        for seed, reference_kept, full in zip(
            expected["seeds"], expected["kept"], expected["image_tokens"], strict=True
        ):
            assert kept[seed] == reference_kept, request["prompt"]
            dropped += full - len(reference_kept)
        assert len(single.prompt_token_ids) == expected["prompt_tokens"] - dropped, request["prompt"]
    first, second = (reference[index]["kept"][0] for index in shared)
    assert first != second, "the shared image keeps the same tokens under both prompts: the test cannot see the text"


def reference_of(folder: Path, family: str, options: dict[str, Any], requests: list[dict[str, Any]], work: Path) -> Any:
    specs = []
    for request in requests:
        asked = request.get("mm_processor_kwargs", {}).get("vitrim", {})
        one = {key: value for key, value in request.items() if key != "mm_processor_kwargs"}
        if "question" in asked:
            one["question"] = asked["question"]
        own = {key: value for key, value in asked.items() if key != "question"}  # keep, the method's options
        specs.append(
            {
                "folder": str(folder),
                "family": family,
                "method": "cdpruner",
                "options": {**options, **own},
                "positions": "original",
                "max_tokens": MAX_TOKENS,
                "requests": [one],
            }
        )
    return [one[0] for one in transformers_reference(specs, work)]


def test_llava_selects_on_each_prompts_text_after_its_image(work: Path) -> None:
    folder = save_vllm_llava(work / "tiny-llava")
    requests = make_requests(work, "llava", (16, 20), seed=3)

    def run(llm: Any) -> Any:
        runs = served(llm, requests)
        asked = {**requests[0], "mm_processor_kwargs": {"vitrim": {"question": "what?"}}}
        refused(llm, asked, "vitrim: this request's question is read by cdpruner with relevance='clip'", requests[0])
        return runs

    runs = with_engine(folder, overrides(LLAVA, "cdpruner", keep=6), run)
    assert_equals_reference(requests, runs, reference_of(folder, "llava", {"keep": 6}, requests, work))


@pytest.fixture(scope="module")
def clip(work: Path) -> Path:
    """A tiny CLIP whose vision width is the tiny LLaVA tower's (its post-LayerNorm and projection read the feature
    layer), a text tower of 8 positions (a longer question is cut in segments)."""
    vision = VLLM_LLAVA_VISION | {"model_type": "clip_vision_model", "image_size": 16, "patch_size": 4}
    return save_tiny_clip(work / "tiny-clip", *tiny_clip(vision | {"num_hidden_layers": 1}, 24, segment=8, seed=5))


def test_the_clip_is_loaded_when_the_engine_starts_and_must_read_the_towers_width(clip: Path) -> None:
    import torch

    from vitrim.vllm.prompt_instruction import load_clip
    from vitrim.vlm.method.base import method_class

    method = method_class("cdpruner")(relevance="clip", clip=str(clip))
    width = VLLM_LLAVA_VISION["hidden_size"]
    with pytest.raises(ValueError, match=rf"^vitrim: cdpruner clip='{clip}' projects {width}-wide tower states, this"):
        load_clip(method, width + 1, torch.device("cpu"))
    load_clip(method, width, torch.device("cpu"))
    assert method.towers is not None  # type: ignore[attr-defined]
    unread = method_class("cdpruner")(clip="/no/such/clip")  # relevance "llm": no CLIP is read, none loaded
    load_clip(unread, width, torch.device("cpu"))
    assert unread.towers is None  # type: ignore[attr-defined]


def test_llava_clip_relevance_reads_each_requests_question(work: Path, clip: Path) -> None:
    """relevance="clip": the question of each request (``texts=`` on transformers) through the tiny CLIP; the same
    image under two questions keeps what each question selects; a request's own ``theta`` selects with the CLIP the
    engine loaded, as transformers at that theta."""
    folder = save_vllm_llava(work / "tiny-llava-clip", seed=1)
    requests = make_requests(work, "llava_clip", (16, 20), seed=4)[:3]
    questions = ["what colour is the cat on the mat?", "is there a dog?", "count the birds, please"]
    for request, question in zip(requests, questions, strict=True):
        request["mm_processor_kwargs"] = {"vitrim": {"question": question}}
    requests[2]["mm_processor_kwargs"]["vitrim"]["theta"] = 0.5  # its own option, on the engine's CLIP
    options = {"keep": 5, "relevance": "clip", "clip": str(clip)}

    def run(llm: Any) -> Any:
        runs = served(llm, requests)
        refused(llm, {**requests[0], "mm_processor_kwargs": {}}, "reads each request's question", requests[1])
        return runs

    runs = with_engine(folder, overrides(LLAVA, "cdpruner", **options), run)
    assert_equals_reference(requests, runs, reference_of(folder, "llava", options, requests, work))


@pytest.mark.parametrize("family", list(QWEN))
def test_qwen_selects_on_each_prompts_text_after_its_image(work: Path, family: str) -> None:
    save = save_vllm_qwen2_5_vl if family == "qwen2_5_vl" else save_vllm_qwen3_vl
    folder = save(work / f"tiny-{family}")
    requests = make_requests(work, family, (16, 24), seed=5)
    clip = work / f"{family}_clip.npy"
    np.save(clip, clip_frames(2, 2, 3, frames_per_patch=2, seed=6))
    video = {**requests[0], "videos": [{"frames": str(clip), "fps": 2.0}]}
    video["prompt"] += " <|vision_start|><|video_pad|><|vision_end|>"

    def run(llm: Any) -> Any:
        runs = served(llm, requests)
        refused(llm, video, "vitrim: method 'cdpruner' reads the prompt per image, and this request holds a video",
                requests[1])  # fmt: skip
        return runs

    engine = {"limit_mm_per_prompt": {"image": 2, "video": 1}}
    runs = with_engine(folder, overrides(QWEN[family], "cdpruner", keep=3), run, **engine)
    assert_equals_reference(requests, runs, reference_of(folder, family, {"keep": 3}, requests, work))
