"""The ``vitrim`` override and the version check, without vLLM (these run in the main suite too).

Each bad value is refused with one line that starts ``vitrim:`` and names it; tests/vllm/test_engine_start.py checks
that an engine start shows these lines.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vitrim.vllm.compat import check_vllm_version
from vitrim.vllm.options import (
    pre_llm_methods,
    refuse_vllm_video_pruning,
    request_options,
    tower_methods,
    trim_options,
    video_methods,
)

LLAVA = "VitrimLlavaForConditionalGeneration"
QWEN2_5 = "VitrimQwen2_5_VLForConditionalGeneration"
QWEN3 = "VitrimQwen3VLForConditionalGeneration"
GEMMA3 = "VitrimGemma3ForConditionalGeneration"


def config(vitrim: Any, model_type: str = "llava") -> SimpleNamespace:
    return SimpleNamespace(model_type=model_type, vitrim=vitrim)


def test_a_good_override_gives_the_method_with_its_options_and_keep() -> None:
    options = trim_options(config({"method": "visionzip", "keep": 8, "dominant": 6}), LLAVA)
    assert options.method.name == "visionzip" and options.method.options["dominant"] == 6
    assert options.tokens(16) == 8
    assert trim_options(config({"method": "random", "keep": 0.5}), LLAVA).tokens(16) == 8


def test_vllm_serving_offers_every_pre_llm_method() -> None:
    # the one encoder seam captures in vLLM what it captures in transformers (issue 49): downsample and scope too;
    # cdpruner reads the prompt, which the front end hands each image (vitrim.vllm.prompt_instruction)
    assert set(pre_llm_methods()) == {
        "random",
        "fastervlm",
        "vispruner",
        "visionzip",
        "divprune",
        "downsample",
        "scope",
        "cdpruner",
    }
    assert "fastv" not in pre_llm_methods() and "pdrop" not in pre_llm_methods()
    assert "cdpruner" in pre_llm_methods(QWEN3) and "cdpruner" not in pre_llm_methods(
        "VitrimGemma3ForConditionalGeneration"
    )
    assert trim_options(config({"method": "cdpruner", "keep": 8}), LLAVA).method.name == "cdpruner"
    assert trim_options(config({"method": "cdpruner", "keep": 8}, "qwen3_vl"), QWEN3).method.name == "cdpruner"


@pytest.mark.parametrize(
    ("vitrim", "model_type", "architecture", "message"),
    [
        ({"method": "cdpruner", "keep": 8}, "llava_next", "VitrimLlavaNextForConditionalGeneration",
         "vitrim: method 'cdpruner' reads the prompt, and VitrimLlavaNextForConditionalGeneration does not hand"),
        ({"method": "cdpruner", "keep": 8}, "gemma3", "VitrimGemma3ForConditionalGeneration",
         "vitrim: method 'cdpruner' reads the prompt, and VitrimGemma3ForConditionalGeneration does not hand"),
        ({"method": "cdpruner", "keep": 8, "relevance": "clip"}, "qwen2_5_vl", QWEN2_5,
         "vitrim: method 'cdpruner' relevance='clip' reads CLIP's projection of the tower's states"),
    ],
)  # fmt: skip
def test_cdpruner_where_the_prompt_or_its_clip_cannot_be_had_is_one_line(
    vitrim: Any, model_type: str, architecture: str, message: str
) -> None:
    assert_refused_in_one_line(vitrim, model_type, architecture, message)
    theta_zero = {**vitrim, "theta": 0}  # the DPP on the images alone reads no prompt: served everywhere
    theta_zero.pop("relevance", None)
    assert trim_options(config(theta_zero, model_type), architecture).method.name == "cdpruner"


def test_a_requests_question_is_taken_where_the_engine_reads_it_and_refused_in_one_line_elsewhere() -> None:
    clip = trim_options(config({"method": "cdpruner", "keep": 8, "relevance": "clip", "clip": "c"}), LLAVA)
    asked = request_options(clip, {"vitrim": {"question": "why?", "keep": 4}})
    assert asked.question == "why?" and asked.tokens(16) == 4 and asked.method is clip.method
    assert request_options(clip, {"vitrim": {"question": "why?"}}).tokens(16) == 8  # the engine's keep
    llm = trim_options(config({"method": "cdpruner", "keep": 8}), LLAVA)
    for engine, entry, message in [
        (llm, {"question": "why?"}, "vitrim: this request's question is read by cdpruner with relevance='clip' alone"),
        (clip, {"question": ""}, "vitrim: this request's question='' must be a non-empty string"),
        (clip, {"question": 3}, "vitrim: this request's question=3 must be a non-empty string"),
        (clip, {"question": "why?", "relevance": "llm"}, "vitrim: this request's relevance='llm' decides what the "),
        (clip, {"question": "why?", "theta": 0}, "vitrim: this request's theta=0 changes whether 'cdpruner' reads"),
        (clip, {}, "vitrim: a request's mm_processor_kwargs 'vitrim' entry takes"),
    ]:
        with pytest.raises(ValueError) as raised:
            request_options(engine, {"vitrim": entry})
        assert message in str(raised.value) and "\n" not in str(raised.value)


def test_the_tower_methods_are_served_on_llava_and_gemma3_only_at_the_engines_keep() -> None:
    assert set(tower_methods()) == {
        "hiprune", "flowcut", "tome", "evit", "topk", "tower_random", "zero_tprune", "diffrate", "pitome", "ppt",
    }  # fmt: skip
    options = trim_options(config({"method": "tome", "keep": 6}), LLAVA)
    assert options.tokens(16) == 6
    assert trim_options(config({"method": "hiprune", "keep": 64}, "gemma3"), GEMMA3).method.name == "hiprune"
    with pytest.raises(ValueError, match=r"^vitrim: method 'tome' reduces inside the tower with reducers built"):
        request_options(options, {"vitrim": {"keep": 4}})
    with pytest.raises(ValueError) as raised:
        trim_options(config({"method": "hiprune", "keep": 8}, "qwen2_5_vl"), QWEN2_5)
    assert f"vitrim: method 'hiprune' reduces inside the vision tower, which the plugin does on {LLAVA}" in str(
        raised.value
    )


def test_pitome_and_ppt_take_no_keep_their_count_is_their_own() -> None:
    # the family fixes the count from its tower (vitrim.vllm.llava: own_count); until then there is none
    for entry in ({"method": "pitome", "ratio": 0.8}, {"method": "ppt", "r": 4}):
        assert trim_options(config(entry), LLAVA).keep is None
        assert trim_options(config(entry, "gemma3"), GEMMA3).keep is None
    for entry, message in [
        ({"method": "pitome", "ratio": 0.8, "keep": 8}, "vitrim: method 'pitome' removes the patches its own options "
         "(ratio) fix, block by block, and takes no 'keep'; drop keep=8"),
        ({"method": "ppt", "r": 4, "keep": 0.5}, "vitrim: method 'ppt' removes the patches its own options (r) fix, "
         "block by block, and takes no 'keep'; drop keep=0.5"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as raised:
            trim_options(config(entry), LLAVA)
        assert str(raised.value) == message


@pytest.mark.parametrize(
    ("vitrim", "model_type", "message"),
    [
        ({"method": "visionzap", "keep": 8}, "llava", "vitrim: unknown vlm method 'visionzap'; expected one of:"),
        ({"method": "fastv", "keep": 8}, "llava", "vitrim: method 'fastv' prunes inside the LLM by its attention"),
        ({"method": "random", "keep": 0}, "llava", "vitrim: keep=0 must be at least 1"),
        ({"method": "random", "keep": 1.5}, "llava", "vitrim: keep=1.5 as a fraction must be in (0, 1]"),
        ({"method": "random", "keep": "8"}, "llava", "vitrim: keep='8' must be an int"),
        ({"method": "random"}, "llava", "vitrim: method 'random' needs 'keep'"),
        ({"method": "random", "keep": 8, "ratio": 2}, "llava", "vitrim: unknown option 'ratio' for vlm method"),
        (None, "llava", "vitrim: architecture VitrimLlavaForConditionalGeneration needs a 'vitrim' entry"),
        ({"method": "random", "keep": 8}, "qwen2_5_vl", "runs 'llava' checkpoints; this one has model_type"),
    ],
)
def test_a_bad_override_is_one_line_naming_the_value(vitrim: Any, model_type: str, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        trim_options(config(vitrim, model_type), LLAVA)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_video_methods_whose_count_the_grid_fixes_are_served_on_qwen2_5_vl_only() -> None:
    assert set(video_methods()) == {"evs", "vidcom2", "temporal_downsample", "flashvid"}
    rate = {"video_pruning_rate": 0.5}
    # a video of 4 temporal patches of 6 tokens: each method's count, by hand
    assert trim_options(config({"method": "evs", **rate}, "qwen2_5_vl"), QWEN2_5).video_tokens(4, 6) == 12
    assert trim_options(config({"method": "evs", **rate}, "qwen2_5_vl"), QWEN2_5).video_tokens(1, 6) == 6  # ≥ P
    assert trim_options(config({"method": "vidcom2", **rate}, "qwen2_5_vl"), QWEN2_5).video_tokens(4, 6) == 12
    downsample = trim_options(config({"method": "temporal_downsample", "stride": 2}, "qwen2_5_vl"), QWEN2_5)
    assert downsample.video_tokens(3, 6) == 12 and downsample.tokens(24) == 24  # images stay whole
    per_patch = trim_options(config({"method": "visionzip", "keep": 3}, "qwen2_5_vl"), QWEN2_5)
    assert per_patch.video_tokens(4, 6) == 12 and per_patch.tokens(24) == 3
    # flashvid with exact_count keeps t·B, B = ⌈P·r·1.25⌉ of which A = ⌈B·0.7⌉ picked: P = 6, r = 0.5: B = 4, so 16;
    # at the default r = 0.25: B = A = 2 (nothing merges), 8; no merging (temporal_threshold 1): t·A = 4·3 = 12
    flashvid = {"method": "flashvid", "exact_count": True}
    assert trim_options(config(flashvid | {"retention_ratio": 0.5}, "qwen3_vl"), QWEN3).video_tokens(4, 6) == 16
    assert trim_options(config(flashvid, "qwen2_5_vl"), QWEN2_5).video_tokens(4, 6) == 8
    still = flashvid | {"retention_ratio": 0.5, "temporal_threshold": 1.0}
    assert trim_options(config(still, "qwen2_5_vl"), QWEN2_5).video_tokens(4, 6) == 12
    with pytest.raises(ValueError, match=r"^vitrim: keep=7 is more than the image's 6 tokens; expected 1 … 6 \("):
        trim_options(config({"method": "random", "keep": 7}, "qwen2_5_vl"), QWEN2_5).video_tokens(2, 6)


@pytest.mark.parametrize(
    ("vitrim", "model_type", "architecture", "message"),
    [
        ({"method": "evs"}, "llava", LLAVA, "vitrim: method 'evs' reduces videos, and VitrimLlava"),
        ({"method": "vidcom2", "keep": 8}, "qwen3_vl", QWEN3, "vitrim: method 'vidcom2' decides each video's count"),
        ({"method": "evs", "keep": 8}, "qwen2_5_vl", QWEN2_5, "vitrim: method 'evs' decides each video's count"),
        ({"method": "fastvid"}, "qwen2_5_vl", QWEN2_5, "vitrim: method 'fastvid' keeps a count that depends on"),
        ({"method": "flashvid"}, "qwen3_vl", QWEN3, "vitrim: method 'flashvid' with exact_count=False rounds each "),
        (
            {"method": "flashvid", "exact_count": "yes"},
            "qwen2_5_vl",
            QWEN2_5,
            "vitrim: exact_count='yes' for vlm method 'flashvid' must be True or False",
        ),
        (
            {"method": "flashvid", "exact_count": True, "keep": 4},
            "qwen2_5_vl",
            QWEN2_5,
            "vitrim: method 'flashvid' decides each video's count itself; drop 'keep'",
        ),
        ({"method": "evs", "video_pruning_rate": 1.0}, "qwen2_5_vl", QWEN2_5, "video_pruning_rate=1.0 must be"),
    ],
)
def test_a_video_method_where_it_cannot_run_is_one_line(
    vitrim: Any, model_type: str, architecture: str, message: str
) -> None:
    assert_refused_in_one_line(vitrim, model_type, architecture, message)


def assert_refused_in_one_line(vitrim: Any, model_type: str, architecture: str, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        trim_options(config(vitrim, model_type), architecture)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_vllms_own_video_pruning_beside_a_vitrim_method_is_one_line() -> None:
    options = trim_options(config({"method": "random", "keep": 3}, "qwen2_5_vl"), QWEN2_5)
    refuse_vllm_video_pruning(None, options)
    with pytest.raises(ValueError, match=r"^vitrim: vLLM's own video pruning \(video_pruning_method='evs', "):
        refuse_vllm_video_pruning(("evs", 0.75), options)


def test_keep_above_an_images_tokens_is_one_line_naming_both() -> None:
    options = trim_options(config({"method": "random", "keep": 17}), LLAVA)
    with pytest.raises(ValueError, match=r"^vitrim: keep=17 is more than the image's 16 tokens; expected 1 … 16$"):
        options.tokens(16)


def test_an_untested_vllm_is_refused_in_one_line_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.1+cpu")
    with pytest.raises(RuntimeError, match=r"^vitrim: vLLM 0.33.0 is not a release vitrim.vllm was tested on"):
        check_vllm_version("0.33.0")
    monkeypatch.setenv("VITRIM_VLLM_UNTESTED", "1")
    check_vllm_version("0.33.0")


def test_llava_next_takes_tiles_as_the_engines_option_and_nothing_else_does() -> None:
    next_ = "VitrimLlavaNextForConditionalGeneration"
    entry = {"method": "fastervlm", "keep": 6, "tiles": "unpadded"}
    options = trim_options(config(entry, "llava_next"), next_)
    assert options.family_options == {"tiles": "unpadded"}
    assert trim_options(config({"method": "fastervlm", "keep": 6}, "llava_next"), next_).family_options == {}
    assert request_options(options, {"vitrim": {"keep": 3}}).family_options == {"tiles": "unpadded"}
    refusals = [
        (config(entry | {"tiles": "cut"}, "llava_next"), next_, "vitrim: tiles='cut': expected one of 'whole', "),
        (config(entry), LLAVA, "vitrim: tiles='unpadded' is an option of LLaVA-NeXT (LlavaNextForConditionalGen"),
    ]
    for hf_config, architecture, message in refusals:
        with pytest.raises(ValueError) as raised:
            trim_options(hf_config, architecture)
        assert message in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=r"^vitrim: this request's tiles='whole' decides how the family lays out an"):
        request_options(options, {"vitrim": {"tiles": "whole"}})


def test_a_request_sets_the_engines_methods_options_as_an_engine_started_with_them_would() -> None:
    engine = trim_options(config({"method": "visionzip", "keep": 6}), LLAVA)
    for entry, keep in [
        ({"dominant": 2, "contextual": 4}, 6),  # the engine's keep
        ({"keep": 8, "contextual": 3, "cls": False}, 8),
        ({"keep": 0.25, "contextual": 0}, 4),  # a fraction, checked against the options once resolved
    ]:
        asked = request_options(engine, {"vitrim": entry})
        options = {key: value for key, value in entry.items() if key != "keep"}
        started = trim_options(config({"method": "visionzip", "keep": entry.get("keep", 6), **options}), LLAVA)
        assert asked.method.options == started.method.options and asked.method.given == started.method.given
        assert asked.tokens(16) == started.tokens(16) == keep and asked.overrides == options
    # no keep anywhere: the request's own default, dominant + contextual, as an engine started so keeps
    default = trim_options(config({"method": "visionzip"}), LLAVA)
    assert (
        default.tokens(576) == 64
        and request_options(default, {"vitrim": {"dominant": 20, "contextual": 4}}).tokens(576) == 24
    )
    assert request_options(engine, {"vitrim": {"keep": 4}}).method is engine.method  # no options: the engine's
    seeded = trim_options(config({"method": "random", "keep": 4, "seed": 3}, "qwen2_5_vl"), QWEN2_5)
    assert request_options(seeded, {"vitrim": {"seed": 5}}).method.options["seed"] == 5


def test_a_requests_bad_or_engine_only_option_is_refused_in_one_line() -> None:
    engine = trim_options(config({"method": "visionzip", "keep": 6}), LLAVA)
    cdpruner = trim_options(config({"method": "cdpruner", "keep": 6}), LLAVA)
    evs = trim_options(config({"method": "evs"}, "qwen2_5_vl"), QWEN2_5)
    flashvid = trim_options(config({"method": "flashvid", "exact_count": True}, "qwen2_5_vl"), QWEN2_5)
    for options, entry, message in [
        (engine, {"dominant": 0}, "vitrim: this request's dominant=0 must be an int >= 1"),
        (engine, {"foo": 1}, "vitrim: this request's unknown option 'foo' for vlm method 'visionzip'; expected one"),
        (engine, {"method": "divprune"}, "vitrim: this request's method='divprune' is the engine's ('visionzip'"),
        (engine, {"positions": "original"}, "vitrim: this request's positions='original' decides the prompt's layo"),
        (engine, {"cls": True}, "vitrim: this request's cls=True hands the LLM the tower's [CLS] or fails where"),
        (engine, {"dominant": 3, "contextual": 1, "keep": 6}, "vitrim: this request's keep=6 differs from dominant"),
        (engine, {"contextual": 2.5}, "vitrim: this request's contextual=2.5 must be an int >= 0"),
        (engine, {"contextual": {1, 2}}, "vitrim: this request's options must be JSON values (numbers, strings)"),
        (cdpruner, {"relevance": "clip"}, "vitrim: this request's relevance='clip' decides what the selection reads"),
        (cdpruner, {"clip": "other"}, "vitrim: this request's clip='other' names the CLIP the engine loads when it"),
        (cdpruner, {"theta": 0}, "vitrim: this request's theta=0 changes whether 'cdpruner' reads the prompt"),
        (cdpruner, {"theta": 1.5}, "vitrim: this request's theta=1.5 must be None or a number in [0, 1)"),
        (evs, {"keep": 4}, "vitrim: method 'evs' decides each video's count itself, from its options; this request"),
        (evs, {"video_pruning_rate": 1.5}, "vitrim: this request's video_pruning_rate=1.5 must be"),
        (flashvid, {"exact_count": False}, "vitrim: this request's options: method 'flashvid' with exact_count=False"),
    ]:
        with pytest.raises(ValueError) as raised:
            request_options(options, {"vitrim": entry})
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)
    # a count the request's options cannot keep, known once the image's tokens are: refused in the front end
    with pytest.raises(ValueError, match=r"^vitrim: this request's keep=8 differs from dominant \+ contextual"):
        request_options(engine, {"vitrim": {"keep": 0.5, "dominant": 4, "contextual": 2}}).tokens(16)
    assert request_options(cdpruner, {"vitrim": {"theta": 0.5}}).method.options["theta"] == 0.5
    # a video method's options decide each video's count in the front end, as at engine start
    assert request_options(evs, {"vitrim": {"video_pruning_rate": 0.5}}).video_tokens(4, 6) == 12
    assert evs.video_tokens(4, 6) == 6
