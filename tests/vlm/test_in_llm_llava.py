"""The in-LLM methods through ``vitrim.vlm.apply`` on a tiny LlavaForConditionalGeneration: the forward and
``generate()`` equal the unmodified model with the dropped image keys masked from layer K on (the LLM's inputs
read from the unmodified model; the decode positions read from transformers' own calls), keep=all is the
unmodified model bit for bit, and bad options are refused at apply with the model left as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from llm_reference import masked_layers

import vitrim.vlm
from tiny_vlms.llava import GRID_TOKENS, batch, pixels, prompt, tiny_llava

APPLIED = {
    "fastv": {"layer": 1, "keep": 5},
    "dart": {"layer": 1, "keep": 6, "pivot_image_token": 2, "pivot_text_token": 2},
    "pdrop": {"layers": (1,), "ratios": (0.25,)},
}


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    prompts = [prompt(2, 3, seed=seed), prompt(5, 1, seed=seed + 1), prompt(1, 4, seed=seed + 2)]
    input_ids, attention_mask = batch(prompts, "left")
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixels(3, seed=seed)}


def _llm_calls(model: torch.nn.Module) -> tuple[list[dict[str, Any]], Any]:
    """Record the keyword arguments of every call of the LLaVA's language model (transformers' own inputs)."""
    calls: list[dict[str, Any]] = []
    handle = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True
    )
    return calls, handle


def _vitrim_hooks(model: torch.nn.Module) -> int:
    """Hooks a vitrim module put on ``model`` (transformers adds its own output-capturing hooks on a first call)."""
    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    return sum(getattr(hook, "__module__", "").startswith("vitrim") for hook in hooks)


def _kept_keys(input_ids: torch.Tensor, selection: list[torch.Tensor]) -> torch.Tensor:
    """(B, L) bool: text positions and the kept image tokens (one image per sample, in reading order)."""
    keep = input_ids != 3
    for sample, kept in enumerate(selection):
        columns = (input_ids[sample] == 3).nonzero().flatten()
        keep[sample, columns[kept]] = True
    return keep


@pytest.mark.parametrize("name", ["fastv", pytest.param("dart", marks=pytest.mark.full), "pdrop"])
def test_apply_drops_inside_the_llm_exactly_as_the_masked_model_and_generate_decodes_on_the_kept_tokens(name):
    model = tiny_llava(seed=1)
    inputs = _inputs()
    vitrim.vlm.apply(model, name, **APPLIED[name])
    assert _vitrim_hooks(model) > 0
    forward_calls, handle = _llm_calls(model)
    out = model(**inputs)
    handle.remove()
    selection = vitrim.vlm.last_selection(model)
    calls, handle = _llm_calls(model)
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    handle.remove()
    generate_selection = vitrim.vlm.last_selection(model)  # generate's positions differ (cumsum): its own ranking
    vitrim.vlm.remove(model)
    assert _vitrim_hooks(model) == 0
    assert [len(kept) for kept in selection] == [APPLIED[name].get("keep", GRID_TOKENS // 4)] * 3
    assert not hasattr(model, "_vitrim_vlm")

    keep = _kept_keys(inputs["input_ids"], selection)
    layer = APPLIED[name].get("layer", 1)
    lm = model.model.language_model
    embeds, mask = forward_calls[0]["inputs_embeds"], inputs["attention_mask"]
    hidden = masked_layers(lm, embeds, mask, forward_calls[0].get("position_ids"), {layer: keep})
    reference = model.lm_head(hidden)
    assert (out.logits - reference)[mask.bool() & keep].abs().max() <= 1e-12

    keep = _kept_keys(inputs["input_ids"], generate_selection)
    embeds, mask = calls[0]["inputs_embeds"], inputs["attention_mask"]
    cache = __import__("transformers").DynamicCache(config=lm.config)
    logits = model.lm_head(masked_layers(lm, embeds, mask, calls[0].get("position_ids"), {layer: keep}, cache))
    tokens = []
    for step in range(3):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        past = mask.shape[1]
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        keep = torch.cat([keep, torch.ones(3, 1, dtype=torch.bool)], dim=1)
        if step < 2:
            step_embeds = lm.embed_tokens(token)
            position_ids = calls[step + 1].get("position_ids")
            hidden = masked_layers(lm, step_embeds, mask, position_ids, {layer: keep}, cache, past)
            logits = model.lm_head(hidden)
    assert torch.equal(generated[:, inputs["input_ids"].shape[1] :], torch.cat(tokens, dim=1))


def test_keep_all_inside_the_llm_is_the_unmodified_llava_bit_for_bit():
    model = tiny_llava(seed=2)
    inputs = _inputs(seed=2)
    plain = model(**inputs).logits
    plain_generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    for name, options in (("fastv", {"layer": 1, "keep": GRID_TOKENS}), ("pdrop", {"layers": (1,), "ratios": (1.0,)})):
        vitrim.vlm.apply(model, name, **options)
        assert torch.equal(model(**inputs).logits, plain)
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), plain_generated)
        assert [kept.tolist() for kept in vitrim.vlm.last_selection(model)] == [list(range(GRID_TOKENS))] * 3
        vitrim.vlm.remove(model)


@pytest.mark.full
def test_beam_search_with_keep_all_is_the_unmodified_beam_search():
    model = tiny_llava(seed=3)
    inputs = _inputs(seed=3)
    plain = model.generate(**inputs, max_new_tokens=4, do_sample=False, num_beams=2)
    vitrim.vlm.apply(model, "fastv", layer=1, keep=GRID_TOKENS)
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False, num_beams=2), plain)
    vitrim.vlm.remove(model)
    vitrim.vlm.apply(model, "fastv", layer=1, keep=4)
    pruned = model.generate(**inputs, max_new_tokens=4, do_sample=False, num_beams=2)
    selection = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    assert pruned.shape == plain.shape
    assert all(torch.equal(selection[2 * i], selection[2 * i + 1]) for i in range(3))  # beams of one prompt


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("fastv", {"layer": 2}, r"drop layer 2 \(layer= / layers=\) is outside the LLM"),
        ("fastv", {"layer": 0}, "drop layer 0"),
        ("fastv", {"layer": 1.5}, r"layer=1.5 must be an int"),
        ("fastv", {"keep": GRID_TOKENS + 1}, "keep=17 is more than the image's 16 tokens"),
        ("dart", {"pivot_image_token": 0}, "pivot_image_token=0 must be an int >= 1"),
        ("pdrop", {}, r"drop layer 8 \(layer= / layers=\) is outside the LLM"),
        ("pdrop", {"layers": (1,), "ratios": (0.5,), "keep": 4}, "pdrop drops in stages"),
        ("pdrop", {"layers": (1,), "ratios": (0.5, 0.25)}, "must be non-empty and of the same length"),
        ("fastv", {"ratio": 0.5}, "unknown option 'ratio' for vlm method 'fastv'"),
    ],
)
def test_bad_in_llm_options_are_refused_at_apply_and_leave_the_model_as_it_was(name, options, message):
    model = tiny_llava()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises((ValueError, TypeError), match=message):
        vitrim.vlm.apply(model, name, **options)
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    assert hooks == 0 and not hasattr(model, "_vitrim_vlm")
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


def test_the_methods_defaults_are_the_authors():
    model = tiny_llava(seed=4)
    inputs = _inputs(seed=4)
    with pytest.raises(ValueError, match="drop layer 2"):  # FastV's and DART's K = 2: this LLM has 2 layers
        vitrim.vlm.apply(model, "fastv")
    with pytest.raises(ValueError, match="drop layer 8"):  # PyramidDrop's layers (8, 16, 24)
        vitrim.vlm.apply(model, "pdrop")
    expected = {"fastv": 8, "dart": 4}  # FastV: R = 50 % of 16; DART: 1 − 0.778 of 16 = 3.55 -> 4 (128 of 576)
    for name, count in expected.items():
        vitrim.vlm.apply(model, name, layer=1)
        model(**inputs)
        assert [len(kept) for kept in vitrim.vlm.last_selection(model)] == [count] * 3
        vitrim.vlm.remove(model)
    with pytest.raises(ValueError, match=r"ratios=\(0.5, 0.25, 0.125\) must be non-empty and of the same length"):
        vitrim.vlm.apply(model, "pdrop", layers=(1,))  # the default ratios need three layers
