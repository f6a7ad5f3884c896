"""After ``vitrim.vlm.remove`` a Qwen2.5-VL is the model it would be had vitrim never touched it: the same calls
leave the same ``rope_deltas`` (the M-RoPE offset transformers stores at a prefill and reads at a decode step on a
cache, or at a call with ``inputs_embeds`` alone), and the next calls give the same logits and generations.

Issue 53 reported ``rope_deltas`` changed after FastV or DART under eager attention; on this tiny model they are the
never-touched model's (FastV and DART leave them to transformers: kept here as a guard). A pre-LLM stage does change
them (the pruned prefill's cache is shorter, so the decode offset grows by the dropped count), and its ``remove()``
put back the value from before ``apply`` (None here) where the never-touched model holds the last prefill's: a call
with ``inputs_embeds`` then took other positions.
"""

from __future__ import annotations

import pytest
import torch

import vitrim.vlm
from tiny_vlms import qwen

METHODS = {"fastv": {"layer": 1, "keep": 2}, "dart": {"layer": 1, "keep": 2}, "divprune": {"keep": 2}}


@pytest.mark.parametrize("name", ["divprune", "fastv", pytest.param("dart", marks=pytest.mark.full)])
def test_remove_leaves_qwen2_5_vl_as_a_never_touched_model_after_the_same_calls(name: str) -> None:
    touched, never = qwen.qwen2_5_vl(seed=0), qwen.qwen2_5_vl(seed=0)
    for model in (touched, never):
        model.set_attn_implementation("eager")
    inputs = qwen.batch([([[1, 5, 6], [7, 8, 9]], [(4, 6)]), ([[1, 5, 6, 7], [7, 8, 9]], [(4, 4)])])
    vitrim.vlm.apply(touched, name, **METHODS[name])
    touched.generate(**inputs, max_new_tokens=3, do_sample=False)
    vitrim.vlm.remove(touched)
    never.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(touched.model.rope_deltas, never.model.rope_deltas)
    embeds = never.get_input_embeddings()(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    assert torch.equal(touched(inputs_embeds=embeds).logits, never(inputs_embeds=embeds).logits)
    generated = [model.generate(**inputs, max_new_tokens=3, do_sample=False) for model in (touched, never)]
    assert torch.equal(*generated)
