"""The ``vitrim`` override and the version check, without vLLM (these run in the main suite too).

Each bad value is refused with one line that starts ``vitrim:`` and names it; tests/vllm/test_engine_start.py checks
that an engine start shows these lines.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vitrim.vllm.compat import check_vllm_version
from vitrim.vllm.options import pre_llm_methods, trim_options

LLAVA = "VitrimLlavaForConditionalGeneration"


def config(vitrim: Any, model_type: str = "llava") -> SimpleNamespace:
    return SimpleNamespace(model_type=model_type, vitrim=vitrim)


def test_a_good_override_gives_the_method_with_its_options_and_keep() -> None:
    options = trim_options(config({"method": "visionzip", "keep": 8, "dominant": 6}), LLAVA)
    assert options.method.name == "visionzip" and options.method.options["dominant"] == 6
    assert options.tokens(16) == 8
    assert trim_options(config({"method": "random", "keep": 0.5}), LLAVA).tokens(16) == 8


def test_vllm_serving_offers_every_pre_llm_method_that_selects_from_the_images_alone() -> None:
    # the one encoder seam captures in vLLM what it captures in transformers (issue 49): downsample and scope too
    assert set(pre_llm_methods()) == {
        "random",
        "fastervlm",
        "vispruner",
        "visionzip",
        "divprune",
        "downsample",
        "scope",
    }
    assert "fastv" not in pre_llm_methods() and "pdrop" not in pre_llm_methods()
    with pytest.raises(ValueError, match=r"vitrim: method 'cdpruner' reads the prompt"):
        trim_options(config({"method": "cdpruner", "keep": 8}), LLAVA)
    assert trim_options(config({"method": "cdpruner", "keep": 8, "theta": 0}), LLAVA).method.name == "cdpruner"


@pytest.mark.parametrize(
    ("vitrim", "model_type", "message"),
    [
        ({"method": "visionzap", "keep": 8}, "llava", "vitrim: unknown vlm method 'visionzap'; expected one of:"),
        ({"method": "fastv", "keep": 8}, "llava", "vitrim: method 'fastv' cuts at stage 'in_llm'"),
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
