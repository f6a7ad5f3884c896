"""The pre-LLM stage re-pads a batch whose samples kept different counts with filler columns; under eager attention in
float64 a filler row that sees no key is NaN, and 0 × NaN carried it into the real rows (issue 45). Here, on every
family the stage takes: two UNPADDED prompts of one length with 1 and 2 images (so the unmodified model has no row
without a key, and after FasterVLM one of them is re-padded with fillers); each sample of the batch must equal
itself alone to 1e-12, at the prefill and at every decode step, where the fillers must stay invisible."""

from __future__ import annotations

import pytest
import torch

import vitrim.vlm
from tiny_vlms import gemma3 as tiny_gemma3
from tiny_vlms import llava as tiny_llava
from tiny_vlms import qwen as qwen_tiny
from tiny_vlms.llava_next import tiny_llava_next

TOL = 1e-12
KEEP = 4
STEPS = 3


def llava(attn: str, text: dict | None = None):
    """LLaVA; ``text``: options of its LLM's config (another ``model_type``, a sliding window)."""
    model = tiny_llava.tiny_llava(attn=attn, seed=5, text=text)
    one = tiny_llava.prompt(2 + tiny_llava.GRID_TOKENS + 2, 3, images=1, seed=1)
    two = tiny_llava.prompt(2, 3, images=2, seed=2)
    return model, _stacked([one, two], tiny_llava.pixels(3, seed=3), [1, 2])


def _stacked(prompts: list[torch.Tensor], pixels: torch.Tensor, images: list[int], extra=None):
    """The batch of ``prompts`` (one length, no padding) and each prompt alone, with its own images' pixels."""
    assert len({len(p) for p in prompts}) == 1
    ids = torch.stack(prompts)
    together = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
    alone, first = [], 0
    for row, count in enumerate(images):
        one = ids[row : row + 1]
        mine = pixels[first : first + count]
        alone.append({"input_ids": one, "attention_mask": torch.ones_like(one), "pixel_values": mine})
        first += count
    if extra is not None:
        for inputs in [together, *alone]:
            inputs.update(extra(inputs))
    return together, alone


def gemma3(attn: str):
    model = tiny_gemma3.tiny_gemma3(attn=attn, seed=5)
    one = tiny_gemma3.prompt(2 + tiny_gemma3.GRID_TOKENS + 3, 3, images=1, seed=1)
    two = tiny_gemma3.prompt(2, 3, images=2, seed=2)
    types = lambda inputs: {"token_type_ids": tiny_gemma3.token_types(inputs["input_ids"])}  # noqa: E731
    return model, _stacked([one, two], tiny_gemma3.pixels(3, seed=3), [1, 2], types)


def llava_next(attn: str):
    model = tiny_llava_next()
    model.set_attn_implementation(attn)
    image = tiny_llava.IMAGE_TOKEN
    one = torch.tensor([5] * 12 + [image] * 88 + [7] * 7)  # a 2×2-tile image of 30×30 px
    two = torch.tensor([5] + [image] * 52 + [7] + [image] * 52 + [8])  # two 1×2-tile images of 20×40 px
    pixels = torch.randn(3, 5, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sizes = torch.tensor([[30, 30], [20, 40], [20, 40]])
    together, alone = _stacked([one, two], pixels, [1, 2])
    together["image_sizes"], alone[0]["image_sizes"], alone[1]["image_sizes"] = sizes, sizes[:1], sizes[1:]
    return model, (together, alone)


def qwen(builder: str, text: dict | None = None):
    def make(attn: str):
        model = getattr(qwen_tiny, builder)(**({} if text is None else {"text": text}))
        model.set_attn_implementation(attn)
        one = ([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9]], [(4, 6)])  # 11 + 1 + 6 + 1 + 3 tokens
        two = ([[1, 5, 6], [7, 8], [9, 10, 11, 12, 13]], [(4, 4), (4, 4)])  # 3 + 6 + 2 + 6 + 5 tokens
        together = qwen_tiny.batch([one, two])
        alone = [qwen_tiny.batch([one]), qwen_tiny.batch([two])]
        patches = 4 * 6
        alone[0]["pixel_values"] = together["pixel_values"][:patches]  # batch() draws every image in turn
        alone[1]["pixel_values"] = together["pixel_values"][patches:]
        return model, (together, alone)

    return make


FAMILIES = {
    "llava": llava,
    "llava_next": llava_next,
    "gemma3": gemma3,
    "qwen2_vl": qwen("qwen2_vl"),
    "qwen2_5_vl": qwen("qwen2_5_vl"),
    "qwen3_vl": qwen("qwen3_vl"),
    # the LLM's sliding window binds (windowed layers counted as transformers counts them from the 2-D mask):
    "llava_mistral_window": lambda attn: llava(attn, {"model_type": "mistral", "sliding_window": 6}),
    "qwen2_vl_mixed_window": qwen(
        "qwen2_vl",
        {"use_sliding_window": True, "sliding_window": 5, "layer_types": ["full_attention", "sliding_attention"]},
    ),
}


def _generated(model, inputs: dict):
    return model.generate(
        **inputs, max_new_tokens=STEPS, do_sample=False, output_scores=True, return_dict_in_generate=True
    )


FULL_ONLY = {"qwen2_vl", "llava_mistral_window", "qwen2_vl_mixed_window"}  # Qwen2-VL shares Qwen2.5-VL's seams


@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.full)])
@pytest.mark.parametrize(
    "family", [pytest.param(name, marks=pytest.mark.full) if name in FULL_ONLY else name for name in FAMILIES]
)
def test_each_sample_of_a_batch_re_padded_with_fillers_equals_itself_alone(family: str, attn: str) -> None:
    model, (together, alone) = FAMILIES[family](attn)
    vitrim.vlm.apply(model, "fastervlm", keep=KEEP)
    try:
        with torch.no_grad():
            logits = model(**together).logits  # (2, L', V)
            singles = [model(**inputs).logits[0] for inputs in alone]  # (L'_b, V) each
            batch_run, single_runs = _generated(model, together), [_generated(model, inputs) for inputs in alone]
    finally:
        vitrim.vlm.remove(model)
    widths = [len(single) for single in singles]
    assert min(widths) < max(widths) == logits.shape[1]  # one prompt was re-padded with fillers (on the left)
    # eager attention takes its softmax in float32, and torch's CPU kernel computes a row shorter than 16 another way
    # (a 15-token prompt alone is 5e-7 off itself in a wider batch, before and after this fix): rows of 16 and more
    assert min(widths) >= 16
    assert torch.isfinite(logits).all()
    for row, single in enumerate(singles):
        assert (logits[row, -len(single) :] - single).abs().max() <= TOL
        own_scores = single_runs[row].scores  # fewer than STEPS when that prompt alone reached its end token
        for step, (batched, own) in enumerate(zip(batch_run.scores[: len(own_scores)], own_scores, strict=True)):
            assert torch.isfinite(batched[row]).all(), step
            assert (batched[row] - own[0]).abs().max() <= TOL, step
