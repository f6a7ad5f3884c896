"""A left-padded batch through an in-LLM drop under eager attention equals each prompt alone (kept tokens and the
last token's logits), on a tiny LLaVA and a tiny Qwen2-VL in float64 with a 4-layer LLM and PyramidDrop's three
stages.

Why it could not: transformers' eager attention takes its softmax in float32, where a float64 mask's minimum is
−inf, so a left-padding row (it sees no key) is NaN after layer 0 and the next layer carries the NaN into every
real row as 0 × NaN; PyramidDrop's later stages then ranked NaN and kept other tokens than the prompt alone (the
unmodified model's logits there are NaN too). The drop gives each such row its own key.
"""

from __future__ import annotations

import pytest
import torch

import vitrim.vlm
from tiny_vlms import qwen
from tiny_vlms.llava import batch, pixels, prompt, tiny_llava
from vitrim.vlm.stages.filler_masks import additive_with_own_key_where_blank, as_additive

PDROP = {"layers": (1, 2, 3), "ratios": (0.5, 0.25, 0.125)}
FOUR_LAYERS = {"num_hidden_layers": 4}


def _kept(model: torch.nn.Module) -> list[list[int]]:
    return [kept.tolist() for kept in vitrim.vlm.last_selection(model)]


def test_pdrop_eager_left_padded_llava_batch_equals_each_prompt_alone() -> None:
    model = tiny_llava(attn="eager", seed=0, text=FOUR_LAYERS)
    vitrim.vlm.apply(model, "pdrop", **PDROP)
    prompts = [prompt(2, 3, images=2, seed=0), prompt(5, 1, seed=1), prompt(1, 4, seed=2)]
    images = [2, 1, 1]
    picture = pixels(4, seed=0)
    input_ids, attention_mask = batch(prompts, "left")
    together = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=picture).logits[:, -1]
    kept_together = _kept(model)
    first = 0
    for sample, (ids, count) in enumerate(zip(prompts, images, strict=True)):
        alone = model(input_ids=ids[None], pixel_values=picture[first : first + count]).logits[0, -1]
        assert kept_together[first : first + count] == _kept(model)
        # LLaVA numbers a padded row's positions from the padding: rotary tables in float32, ~1e-7 apart
        torch.testing.assert_close(together[sample], alone, rtol=0, atol=1e-5)
        first += count


def test_pdrop_eager_left_padded_qwen2_vl_batch_equals_each_prompt_alone() -> None:
    model = qwen.qwen2_vl(seed=0, text=FOUR_LAYERS)
    model.set_attn_implementation("eager")
    vitrim.vlm.apply(model, "pdrop", **PDROP)
    prompts = [([[1, 5], [7, 8, 9, 10, 11], [12]], [(4, 4), (4, 6)]), ([[1, 5, 6], [7, 8, 9]], [(4, 6)])]
    inputs = qwen.batch(prompts, seed=0, side="left")
    # eager attention's softmax is taken in float32 (transformers'), over a padded row's longer key range in the
    # batch: its rounding depends on the CPU's vector width (1.8e-8 apart on an AVX-512 machine, equal on others);
    # the failure this test guards against (NaN rows, other tokens kept) is off by O(1)
    qwen.assert_batch_is_each_alone(model, prompts, inputs, atol=1e-6)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_rows_seeing_no_key_see_their_own_and_real_rows_are_untouched(side: str) -> None:
    real = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    if side == "right":
        real = real.flip(1)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    allowed = causal[None, None] & real[:, None, None, :]
    mask = as_additive(allowed, torch.float64)
    fixed = additive_with_own_key_where_blank(mask)
    blank = ~allowed.any(-1)  # (B, 1, L): rows that saw no key
    assert bool(blank.any()) == (side == "left")
    assert torch.equal(fixed[~blank], mask[~blank])  # every row that saw a key sees the same keys
    rows = blank.nonzero()
    for b, h, q in rows.tolist():
        assert (fixed[b, h, q] == 0).nonzero().flatten().tolist() == [q]
    if side == "right":
        assert fixed is mask
