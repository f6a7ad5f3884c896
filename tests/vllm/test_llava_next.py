"""VitrimLlavaNextForConditionalGeneration on vLLM's CPU backend against transformers + vitrim.vlm on the same folder.

One engine (VisionZip, 6 tokens per tile: the tower's attention, merged tokens written before the projector) runs
five requests in one ``generate`` call, then each alone: images of four aspect ratios (1×2, 2×2 and 2×1 tile grids),
two of them in one prompt, one request at its own ``keep``, and one whose image the unpadding cuts through a tile
at ``keep`` = 16 (every token). Each request's greedy tokens equal transformers + vitrim.vlm's, its kept packed
positions (newlines included) equal ``vitrim.vlm.last_selection``'s, and its prompt is shorter than the unpruned one
by exactly the dropped tokens (and each image's placeholders are the count by hand). The cut image at the engine's
keep is refused in one line, and the engine goes on. Three mistakes put into the plugin on purpose (a misplaced
kept token, the packing without its newline tokens, the kept tokens in reverse order) each change the tokens of the
same engine. The engine-start refusals, on real starts. Every other pre-LLM method, and keep = 16 against vLLM's
unmodified class: under ``-m full`` (an engine each).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

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

from tiny_vlms.folders import save_vllm_llava_next
from vitrim.vllm.options import pre_llm_methods

ARCHITECTURE = "VitrimLlavaNextForConditionalGeneration"
TILE = 16  # tokens of one 16-px tile of 4-px patches
IMAGE_TOKEN = 3  # the tiny folders' <image>
KEEP = 6
OWN_KEEP = 3
MAX_TOKENS = 8
METHOD = "visionzip"
# mistakes put into the plugin on purpose (make_mistake): each must change some request's tokens
MISTAKES = ("misplaced", "newline", "order")
# (height, width): 1×2, 2×2, 2×1, 2×2, 2×1 tile grids the unpadding leaves whole (22, 38, 26, 38, 26 tokens at
# keep 6); then a 2×2 grid whose 8 token rows it unpads to 6, cutting a row off each of the 4 tiles
SIZES = [(20, 40), (30, 30), (40, 20), (24, 24), (36, 18), (20, 30)]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llava_next")


@pytest.fixture(scope="module")
def folder(work: Path) -> Path:
    return save_vllm_llava_next(work / "tiny-llava-next")


@pytest.fixture(scope="module")
def images(work: Path) -> list[str]:
    paths = random_pictures(work, SIZES, seed=0)
    return paths


def at_keep(keep: int) -> dict[str, Any]:
    return {"mm_processor_kwargs": {"vitrim": {"keep": keep}}}


@pytest.fixture(scope="module")
def requests(images: list[str]) -> list[dict[str, Any]]:
    """Five prompts; the engine's keep for the first three, their own for the last two (the last: every token)."""
    return [
        {"prompt": "w10 w11 <image> w12 w13", "images": [images[0]]},
        {"prompt": "w20 <image> w21 w22 w23 w24 w25 w26", "images": [images[1]]},
        {"prompt": "w30 w31 <image> w32 <image> w33", "images": [images[2], images[3]]},
        {"prompt": "w40 <image> w41 w42", "images": [images[4]], **at_keep(OWN_KEEP)},
        {"prompt": "w50 w51 <image> w52", "images": [images[5]], **at_keep(TILE)},
    ]


def reference_runs(work: Path, folder: Path, method: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers + vitrim.vlm on each request at its keep (one process), in request order."""
    keeps = [request.get("mm_processor_kwargs", {}).get("vitrim", {}).get("keep", KEEP) for request in requests]
    specs = [
        {
            "folder": str(folder),
            "family": "llava_next",
            "method": method,
            "options": {"keep": keep},
            "positions": "original",  # vitrim.vlm as it is (its default: the authors' contiguous sequence)
            "max_tokens": MAX_TOKENS,
            "requests": [request for request, asked in zip(requests, keeps, strict=True) if asked == keep],
        }
        for keep in sorted(set(keeps))
    ]
    by_keep = {spec["options"]["keep"]: iter(out) for spec, out in zip(specs, transformers_reference(specs, work))}
    return [next(by_keep[keep]) for keep in keeps]


@pytest.fixture(scope="module")
def served(folder: Path, requests: list[dict[str, Any]], images: list[str]) -> dict[str, Any]:
    """The one engine: the requests together and alone, what it kept, a cut image's refusal, and a request after."""

    def run(llm: Any) -> dict[str, Any]:
        from vitrim.vllm.selection_record import recorded_selections

        together = greedy(llm, requests, MAX_TOKENS)
        alone = [greedy(llm, [request], MAX_TOKENS)[0] for request in requests]
        kept = recorded_selections(llm)
        with pytest.raises(ValueError) as refused:
            greedy(llm, [{"prompt": "w60 <image> w61", "images": [images[5]]}], MAX_TOKENS)
        after = greedy(llm, requests[:1], MAX_TOKENS)
        mistaken = {}
        for name in MISTAKES:
            with pytest.MonkeyPatch.context() as patch:
                make_mistake(name, patch)
                named = [request | {"uuids": [f"{name}{i}-{j}" for j in range(len(request["images"]))]}
                         for i, request in enumerate(requests)]  # fmt: skip
                mistaken[name] = greedy(llm, named, MAX_TOKENS)
        return {"runs": (together, alone, kept), "refused": str(refused.value), "after": after, "mistaken": mistaken}

    return with_engine(folder, overrides(ARCHITECTURE, METHOD, keep=KEEP), run)


def make_mistake(name: str, patch: pytest.MonkeyPatch) -> None:
    """Put one mistake into the plugin (its module's names, in this process, where the engine runs the model)."""
    plugin = importlib.import_module("vitrim.vllm.llava_next")
    model_class = plugin.VitrimLlavaNextForConditionalGeneration
    if name == "misplaced":  # each tile hands on its neighbouring tokens (every kept index + 1)
        select = plugin.select_keeping_each

        def shifted(selector: Any, evidence: Any, keeps: list[int]) -> Any:
            count = evidence.features.shape[1]
            return [type(s).unmerged(((s.kept + 1) % count).sort().values) for s in select(selector, evidence, keeps)]

        patch.setattr(plugin, "select_keeping_each", shifted)
    elif name == "newline":  # the packing without its newline tokens (in the placeholders and the features alike)
        packed = plugin.packed_token_map
        patch.setattr(plugin, "packed_token_map", lambda *args: (m := packed(*args))[m != plugin.NEWLINE])
    else:  # each image's kept tokens in reverse order
        embed = model_class.embed_multimodal
        patch.setattr(model_class, "embed_multimodal", lambda self, **kw: tuple(r.flip(0) for r in embed(self, **kw)))


def test_every_request_keeps_what_vitrim_vlm_keeps_and_generates_what_transformers_does(
    work: Path, folder: Path, requests: list[dict[str, Any]], served: dict[str, Any]
) -> None:
    reference = reference_runs(work, folder, METHOD, requests)
    assert_like_reference(requests, served["runs"], reference)
    # by hand: keep per tile + a newline per grid row (1×2: 3 tiles, 4 rows; 2×2: 5, 8; 2×1: 3, 8); the cut image at
    # keep 16: the base tile's 16 + 6 unpadded rows of 8 and a newline
    by_hand = [[3 * 6 + 4], [5 * 6 + 8], [3 * 6 + 8, 5 * 6 + 8], [3 * OWN_KEEP + 8], [16 + 6 * 9]]
    for out, counts in zip(served["runs"][0], by_hand, strict=True):
        assert out.prompt_token_ids.count(IMAGE_TOKEN) == sum(counts)
    assert reference[4]["kept"][0] == list(range(reference[4]["image_tokens"][0]))


def test_the_sizes_are_what_the_test_says(folder: Path) -> None:
    """Five images whose grid the unpadding leaves whole, the last one cut: what the requests rely on."""
    from transformers import AutoConfig

    from vitrim.vllm.llava_next import entered_tokens

    config = AutoConfig.from_pretrained(folder)
    for height, width in SIZES[:5]:
        entered_tokens(config, height, width, KEEP)
    with pytest.raises(ValueError, match="through 4 of its 4 tiles"):
        entered_tokens(config, *SIZES[5], KEEP)


def test_an_image_the_unpadding_cuts_is_refused_at_a_smaller_keep_and_the_engine_goes_on(
    served: dict[str, Any],
) -> None:
    assert served["refused"].startswith("vitrim: a 30×20 image's anyres grid is unpadded to its aspect ratio")
    assert "keep every token (keep=16)" in served["refused"]
    assert '"tiles": "unpadded"' in served["refused"]  # the option that serves it (test_llava_next_unpadded.py)
    assert served["after"][0].outputs[0].token_ids == served["runs"][0][0].outputs[0].token_ids


@pytest.mark.parametrize("name", MISTAKES)
def test_each_mistake_put_into_the_plugin_changes_the_tokens(name: str, served: dict[str, Any]) -> None:
    right = [list(out.outputs[0].token_ids) for out in served["runs"][0]]
    assert [list(out.outputs[0].token_ids) for out in served["mistaken"][name]] != right


@pytest.mark.full
@pytest.mark.parametrize("method", [name for name in pre_llm_methods(ARCHITECTURE) if name != METHOD])
def test_every_other_method_keeps_what_vitrim_vlm_keeps(
    method: str, work: Path, folder: Path, requests: list[dict[str, Any]]
) -> None:
    runs = trimmed_runs(folder, ARCHITECTURE, method, {"keep": KEEP}, requests, MAX_TOKENS)
    assert_like_reference(requests, runs, reference_runs(work, folder, method, requests))


@pytest.mark.full
def test_keeping_every_token_is_vllms_unmodified_llava_next(
    work: Path, folder: Path, requests: list[dict[str, Any]]
) -> None:
    plain = [{key: value for key, value in request.items() if key != "mm_processor_kwargs"} for request in requests]
    dense = with_engine(folder, None, lambda llm: greedy(llm, plain, MAX_TOKENS))
    kept_all = with_engine(
        folder, overrides(ARCHITECTURE, METHOD, keep=TILE), lambda llm: greedy(llm, plain, MAX_TOKENS)
    )
    for unmodified, trimmed in zip(dense, kept_all, strict=True):
        assert list(trimmed.outputs[0].token_ids) == list(unmodified.outputs[0].token_ids)
        assert trimmed.prompt_token_ids == unmodified.prompt_token_ids


REFUSALS: list[tuple[str, str, dict[str, Any], str]] = [
    ("llava_next", ARCHITECTURE, {"method": "random", "keep": 17},
     "vitrim: keep=17 is more than the image's 16 tokens"),
    ("llava_next", ARCHITECTURE, {"method": "fastervlm", "keep": 4, "positions": "original"},
     "vitrim: positions='original'"),
    ("llava", ARCHITECTURE, {"method": "random", "keep": 4},
     f"vitrim: architecture {ARCHITECTURE} runs 'llava_next' checkpoints; this one has model_type 'llava'"),
    ("llava_next", "VitrimLlavaForConditionalGeneration", {"method": "random", "keep": 4},
     "vitrim: architecture VitrimLlavaForConditionalGeneration runs 'llava' checkpoints; this one has model_type "
     "'llava_next'"),
]  # fmt: skip


@pytest.mark.parametrize(("checkpoint", "architecture", "entry", "message"), REFUSALS)
def test_a_bad_override_stops_the_engine_with_vitrims_one_line(
    checkpoint: str, architecture: str, entry: dict[str, Any], message: str, work: Path, folder: Path
) -> None:
    from tiny_vlms.folders import save_vllm_llava

    path = folder if checkpoint == "llava_next" else work / "tiny-llava"
    if not path.exists():
        save_vllm_llava(path)
    with pytest.raises(ValueError) as raised:
        with_engine(path, {"architectures": [architecture], "vitrim": entry}, lambda llm: None)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)
