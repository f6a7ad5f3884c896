"""What issue 45's fuzz found in the in-LLM and tower stages, each pinned by a case that fails when it comes back:
a prompt that ends on image tokens keeps its last position; a batch re-padded with filler slots stays finite and
equal to each sample alone under eager attention in float64; ``last_selection`` after a forward without images is
[]; a static cache is refused in one line, the same on every family; meta-device inputs are refused naming them."""

from __future__ import annotations

import pytest
import torch
from llm_reference import kept_keys, masked_forward, positions, prompts

import vitrim.vlm
from tiny_vlms.llms import VOCAB, tiny_llama
from vitrim.vlm.method.dart import DartDrop
from vitrim.vlm.method.fastv import FastVDrop
from vitrim.vlm.method.pdrop import PyramidDrop
from vitrim.vlm.stages.in_llm import InLLMDrop
from vitrim.vlm.stages.in_llm_slots import DYNAMIC_CACHE_ONLY
from vitrim.vlm.stages.spans import spans_from_mask

IMAGE_TOKENS = 6
FULL = pytest.mark.full
POLICIES = {
    "fastv": lambda: FastVDrop(layer=2, tokens=lambda n: 1),
    "dart": lambda: DartDrop(layer=1, tokens=lambda n: 1, pivot_image_token=1, pivot_text_token=1),
    "pdrop": lambda: PyramidDrop(layers=(1, 3), ratios=(0.5, 0.2)),
}


def _prefill(model, policy, input_ids, attention_mask, spans):
    drop = InLLMDrop(model.model, policy)
    drop.on_prefill(spans)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask))
    return drop, out


def ending_on_an_image(before: list[int], width: int | None = None, seed: int = 0):
    """Left-padded prompts of ``before[b]`` text tokens then one image of IMAGE_TOKENS positions, nothing after:
    input_ids (B, L), attention_mask (B, L), spans."""
    generator = torch.Generator().manual_seed(seed)
    width = width or max(before) + IMAGE_TOKENS
    input_ids = torch.zeros(len(before), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    is_image = torch.zeros_like(input_ids, dtype=torch.bool)
    for b, count in enumerate(before):
        length = count + IMAGE_TOKENS
        input_ids[b, width - length :] = torch.randint(3, VOCAB, (length,), generator=generator)
        attention_mask[b, width - length :] = 1
        is_image[b, width - IMAGE_TOKENS :] = True
    return input_ids, attention_mask, spans_from_mask(is_image, [IMAGE_TOKENS] * len(before))


@pytest.mark.parametrize("name", ["fastv", "dart", pytest.param("pdrop", marks=FULL)])
def test_a_prompt_that_ends_on_image_tokens_keeps_its_last_position(name):
    model = tiny_llama(seed=3)
    input_ids, attention_mask, spans = ending_on_an_image([3, 5, 2])
    drop, out = _prefill(model, POLICIES[name](), input_ids, attention_mask, spans)
    stages = drop.stage_selections()
    drop.remove()
    for kept in stages[-1]:
        assert IMAGE_TOKENS - 1 in kept.tolist()  # the last position generate() reads
    assert any(len(kept) > 1 for kept in stages[0])  # the method itself ranked another token first somewhere
    drops = {policy.layer: kept_keys(spans, kept) for policy, kept in zip(drop.stages, stages, strict=True)}
    reference = masked_forward(model, input_ids, attention_mask, drops)
    assert (out.logits[:, -1] - reference[:, -1]).abs().max() <= 1e-12


def test_an_image_that_ends_its_prompt_keeps_at_most_one_token_more_than_asked():
    model = tiny_llama(seed=3)
    input_ids, attention_mask, spans = ending_on_an_image([3, 5, 2])
    drop, _ = _prefill(model, FastVDrop(layer=2, tokens=lambda n: 2), input_ids, attention_mask, spans)
    kept = drop.selection()
    drop.remove()
    assert all(len(k) in (2, 3) and IMAGE_TOKENS - 1 in k.tolist() for k in kept)


@pytest.mark.parametrize("name", ["fastv", pytest.param("dart", marks=FULL), "pdrop"])
def test_filler_slots_under_eager_attention_in_float64_keep_each_sample_equal_to_itself_alone(name):
    """Two unpadded prompts of one length with 1 and 2 images: after the drop they keep different counts, so one is
    re-padded with filler slots (no user padding, so the unmodified model has no row that sees no key)."""
    model = tiny_llama(seed=7, implementation="eager")
    input_ids, attention_mask, spans = prompts([(9, 4, 1), (1, 5, 2)], IMAGE_TOKENS, seed=7)
    assert bool(attention_mask.all())
    drop, batched = _prefill(model, POLICIES[name](), input_ids, attention_mask, spans)
    selection = drop.selection()
    drop.remove()
    assert torch.isfinite(batched.logits).all()
    image = 0
    for sample, images in enumerate((1, 2)):
        alone_spans = spans_from_mask(spans.is_image[sample : sample + 1], [IMAGE_TOKENS] * images)
        ids, mask = input_ids[sample : sample + 1], attention_mask[sample : sample + 1]
        drop, alone = _prefill(model, POLICIES[name](), ids, mask, alone_spans)
        assert [k.tolist() for k in drop.selection()] == [k.tolist() for k in selection[image : image + images]]
        drop.remove()
        image += images
        # eager attention takes its softmax in float32: sums over rows of other widths round differently
        assert (batched.logits[sample] - alone.logits[0]).abs().max() <= 1e-5


def _llava():
    from tiny_vlms.llava import batch, pixels, prompt, tiny_llava

    model = tiny_llava(seed=5)
    input_ids, attention_mask = batch([prompt(2, 3, seed=5), prompt(4, 1, seed=6)], "left")
    return model, {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixels(2, seed=5)}


def _gemma3():
    from tiny_vlms.gemma3 import batch, pixels, prompt, tiny_gemma3, token_types

    model = tiny_gemma3(seed=5)
    input_ids, attention_mask = batch([prompt(2, 3, seed=5), prompt(4, 1, seed=6)], "left")
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixels(2, seed=5)}
    return model, {**inputs, "token_type_ids": token_types(input_ids)}


def _qwen2_vl():
    from tiny_vlms.qwen import batch, qwen2_vl

    return qwen2_vl(), batch([([[1, 5], [7, 8, 9]], [(4, 6)]), ([[1, 5, 6, 3], [7]], [(4, 4)])])


def _llava_next():
    from tiny_vlms.llava_next import inputs, tiny_llava_next

    return tiny_llava_next(), inputs()


FAMILIES = {"llava": _llava, "gemma3": _gemma3, "qwen2_vl": _qwen2_vl, "llava_next": _llava_next}


def _text_only(inputs: dict) -> dict:
    return {"input_ids": inputs["input_ids"][:, -3:], "attention_mask": inputs["attention_mask"][:, -3:]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_static_cache_is_refused_in_the_same_words_on_every_family(family):
    model, inputs = FAMILIES[family]()
    vitrim.vlm.apply(model, "fastv", layer=1, keep=2)
    with pytest.raises(ValueError) as refused:
        model.generate(**inputs, max_new_tokens=2, do_sample=False, cache_implementation="static")
    assert str(refused.value) == DYNAMIC_CACHE_ONLY
    assert "\n" not in DYNAMIC_CACHE_ONLY


@pytest.mark.parametrize(
    ("family", "method", "options"),
    [
        ("llava", "fastv", {"layer": 1, "keep": 2}),
        ("qwen2_vl", "pdrop", {"layers": (1,), "ratios": (0.5,)}),
        ("llava", "tome", {"r": 2}),
        pytest.param("gemma3", "evit", {"keep_rate": 0.5}, marks=FULL),
        pytest.param("gemma3", "dart", {"layer": 1, "keep": 2}, marks=FULL),
    ],
)
def test_last_selection_after_a_forward_without_images_is_empty_then_the_next_images(family, method, options):
    model, inputs = FAMILIES[family]()
    vitrim.vlm.apply(model, method, **options)
    with pytest.raises(ValueError, match="has seen no prefill yet"):
        vitrim.vlm.last_selection(model)
    with torch.no_grad():
        model(**inputs)
        first = [k.tolist() for k in vitrim.vlm.last_selection(model)]
        assert len(first) == 2
        model(**_text_only(inputs))
        assert vitrim.vlm.last_selection(model) == []
        assert vitrim.vlm.last_selection(model, groups=True) == []
        model.generate(**_text_only(inputs), max_new_tokens=2, do_sample=False)  # its decode steps too
        assert vitrim.vlm.last_selection(model) == []
        model.generate(**inputs, max_new_tokens=2, do_sample=False)  # decode steps keep the prefill's selection
        assert len(vitrim.vlm.last_selection(model)) == 2


@pytest.mark.parametrize(
    ("family", "method", "options"),
    [("llava", "fastv", {"layer": 1}), ("qwen2_vl", "dart", {"layer": 1}), ("llava", "tome", {"r": 2})],
)
def test_meta_device_inputs_are_refused_naming_the_input(family, method, options):
    model, inputs = FAMILIES[family]()
    vitrim.vlm.apply(model, method, **options)
    with pytest.raises(ValueError, match=r"^input_ids is on the meta device"):
        model(**{name: value.to("meta") for name, value in inputs.items()})
    with torch.no_grad():
        model(**inputs)  # the model still runs afterwards


def test_meta_pixels_are_refused_by_the_tower_stage_where_nothing_else_reads_the_input():
    """Gemma 3's tower stage puts the tokens back on the grid: no vitrim hook reads the ids, the tower reads pixels."""
    model, inputs = FAMILIES["gemma3"]()
    vitrim.vlm.apply(model, "evit", keep_rate=0.5)
    with pytest.raises(ValueError, match=r"^pixel_values is on the meta device"):
        model(**{**inputs, "pixel_values": inputs["pixel_values"].to("meta")})


@pytest.mark.parametrize(("name", "missing"), [("tome", "'r'"), ("pitome", "'ratio'"), ("diffrate", "'merge_kept'")])
def test_a_tower_method_without_its_strength_is_refused_in_vitrims_words(name, missing):
    """Found by the fuzz: ``apply(model, "tome")`` raised Python's own "for_layers() missing 1 required argument"."""
    model, _ = FAMILIES["llava"]()
    with pytest.raises(ValueError, match=rf"^tower method '{name}' needs option\(s\) \[.*{missing}"):
        vitrim.vlm.apply(model, name)
    assert not hasattr(model, "_vitrim_vlm")
