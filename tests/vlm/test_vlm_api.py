"""vitrim.vlm's interface: the registry, and every bad input refused at apply with one clear error, the model left
as it was (no hook, no attribute, the same parameters)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import vitrim.vlm
from tiny_vlms.llava import GRID_TOKENS, tiny_llava, transformers
from vitrim.vlm.keep import parse_keep
from vitrim.vlm.method.base import Method, register_method


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llava()


def hooks_of(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._forward_hooks_with_kwargs) for m in model.modules()
    )


def snapshot(model: torch.nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
    return hooks_of(model), {name: value.clone() for name, value in model.state_dict().items()}


def assert_untouched(model: torch.nn.Module, snap: tuple[int, dict[str, torch.Tensor]]) -> None:
    hooks, before = snap
    assert hooks_of(model) == hooks
    assert not hasattr(model, "_vitrim_vlm")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_methods_lists_the_pre_llm_methods() -> None:
    assert {"random", "fastervlm", "vispruner", "visionzip", "divprune"} <= set(vitrim.vlm.methods())
    assert vitrim.vlm.methods() == sorted(vitrim.vlm.methods())


@pytest.mark.parametrize(
    ("method", "options", "error", "message"),
    [
        ("no_such_method", {"keep": 4}, ValueError, "unknown vlm method 'no_such_method'"),
        ("random", {"keep": 4, "sed": 1}, ValueError, "unknown option 'sed' for vlm method 'random'"),
        ("random", {"keep": 0}, ValueError, "keep=0 must be at least 1"),
        ("random", {"keep": -3}, ValueError, "keep=-3 must be at least 1"),
        ("random", {"keep": GRID_TOKENS + 1}, ValueError, f"keep={GRID_TOKENS + 1} is more than the image's 16"),
        ("random", {"keep": 1.5}, ValueError, "keep=1.5 as a fraction must be in (0, 1]"),
        ("random", {"keep": 0.0}, ValueError, "keep=0.0 as a fraction must be in (0, 1]"),
        ("random", {"keep": float("nan")}, ValueError, "keep=nan"),
        ("random", {"keep": True}, TypeError, "keep=True must be an int"),
        ("random", {"keep": "8"}, TypeError, "keep='8' must be an int"),
        ("random", {}, ValueError, "vlm method 'random' needs keep="),
        ("random", {"keep": 4, "layer": 1}, ValueError, "layer=1 is for in-LLM methods"),
        ("random", {"keep": 4, "seed": "x"}, TypeError, "seed='x' must be an int"),
        ("visionzip", {}, ValueError, "keep=64 is more than the image's 16 tokens"),  # the authors' 54 + 10
        ("visionzip", {"keep": 8, "dominant": 5, "contextual": 2}, ValueError, "keep=8 differs from dominant"),
        ("visionzip", {"keep": 8, "contextual": 9}, ValueError, "visionzip cannot keep 8 tokens"),
        ("visionzip", {"keep": 8, "contextual": -1}, ValueError, "contextual=-1 must be an int >= 0"),
        (
            "vispruner",
            {"keep": 8, "important_ratio": 1.5},
            ValueError,
            "important_ratio=1.5 must be a number in [0, 1]",
        ),
        ("fastervlm", {"keep": 8, "important_ratio": 0.5}, ValueError, "unknown option 'important_ratio'"),
    ],
)
def test_bad_options_are_refused_at_apply_and_leave_the_model(
    model: torch.nn.Module, method: str, options: dict, error: type, message: str
) -> None:
    before = snapshot(model)
    with pytest.raises(error, match=pytest.importorskip("re").escape(message)):
        vitrim.vlm.apply(model, method, **options)
    assert_untouched(model, before)


def test_a_text_only_model_is_refused_naming_its_class() -> None:
    config = transformers.LlamaConfig(
        vocab_size=99, hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2
    )
    llm = transformers.LlamaForCausalLM(config)
    with pytest.raises(TypeError, match=r"does not handle LlamaForCausalLM \(a text-only model"):
        vitrim.vlm.apply(llm, "random", keep=4)
    assert hooks_of(llm) == 0 and not hasattr(llm, "_vitrim_vlm")


def test_an_unhandled_vision_model_and_a_non_module_are_refused() -> None:
    clip = transformers.CLIPVisionModel(
        transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(
        TypeError, match=r"does not handle CLIPVisionModel; it handles: .*LlavaForConditionalGeneration"
    ):
        vitrim.vlm.apply(clip, "random", keep=4)
    with pytest.raises(TypeError, match="must be a transformers vision-language model"):
        vitrim.vlm.apply("llava", "random", keep=4)


def test_remove_and_last_selection_without_apply_say_so(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="no vlm method is applied to this LlavaForConditionalGeneration"):
        vitrim.vlm.remove(model)
    with pytest.raises(ValueError, match="no vlm method is applied"):
        vitrim.vlm.last_selection(model)


def test_keep_fraction_counts_by_round_half_even_and_at_least_one() -> None:
    assert parse_keep(0.5).tokens(576) == 288
    assert parse_keep(0.125).tokens(20) == 2  # 2.5 -> 2 (half to even)
    assert parse_keep(0.175).tokens(20) == 4  # 3.5 -> 4
    assert parse_keep(0.001).tokens(16) == 1
    assert parse_keep(1.0).tokens(16) == 16 and parse_keep(16).keeps_all(16)


def test_register_method_refuses_a_second_class_under_a_name_and_a_generic_option() -> None:
    with pytest.raises(ValueError, match="'random' is registered twice"):

        @register_method("random", stage="pre_llm")
        class Other(Method):
            pass

    with pytest.raises(ValueError, match="may not define the generic option 'keep'"):

        @register_method("test_keeps_keep", stage="pre_llm")
        class KeepsKeep(Method):
            defaults: ClassVar[dict[str, int]] = {"keep": 3}

    with pytest.raises(ValueError, match="stage 'llm' of vlm method 'x' is not one of pre_llm, in_llm, tower"):
        register_method("x", stage="llm")


def test_without_transformers_apply_names_the_extra(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # as if not installed
    with pytest.raises(
        ModuleNotFoundError, match=r"vitrim.vlm needs transformers, which is not installed: pip install 'vitrim\[vlm\]'"
    ):
        vitrim.vlm.apply(model, "random", keep=4)


def test_cls_attention_methods_are_refused_when_the_features_hold_cls() -> None:
    full = tiny_llava()
    full.config.vision_feature_select_strategy = "full"  # the image's tokens are [CLS] and the 16 patches
    before = snapshot(full)
    with pytest.raises(ValueError, match="scores by \\[CLS\\] attention at one tower layer"):
        vitrim.vlm.apply(full, "visionzip", keep=8)
    assert_untouched(full, before)
    with pytest.raises(ValueError, match="keep=18 is more than the image's 17 tokens"):
        vitrim.vlm.apply(full, "divprune", keep=18)
    vitrim.vlm.apply(full, "divprune", keep=17)  # every token: allowed
    vitrim.vlm.remove(full)


def test_content_seed_reads_any_dtype_and_tells_images_apart() -> None:
    from vitrim.vlm.evidence.seeds import content_seed

    image = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        assert content_seed(image.to(dtype)) == content_seed(image.to(dtype).clone())
    assert content_seed(image) != content_seed(image + 1e-3)
    assert 0 <= content_seed(image) < 2**63


def test_inputs_embeds_with_images_is_refused_rather_than_left_unpruned(model: torch.nn.Module) -> None:
    ids = torch.tensor([[5] + [3] * GRID_TOKENS + [6]])
    embeds = model.get_input_embeddings()(ids)
    vitrim.vlm.apply(model, "random", keep=4)
    try:
        with pytest.raises(ValueError, match=r"vitrim.vlm needs input_ids \(not inputs_embeds\)"):
            model(inputs_embeds=embeds, pixel_values=torch.zeros(1, 3, 16, 16, dtype=torch.float64))
        model(input_ids=ids, pixel_values=torch.zeros(1, 3, 16, 16, dtype=torch.float64))
        text = model.model.language_model(inputs_embeds=embeds)  # a direct text call after a prefill: untouched
        assert text.last_hidden_state.shape[1] == ids.shape[1]
    finally:
        vitrim.vlm.remove(model)
